"""TRL's trainers under accumulation: what each loss is a mean over, and the window statistics some losses need.

May import: the folders `integrations/` may import, and `losses/` in particular (`composed_class`,
`composition_error`); never `integrations/registry.py`, which imports these modules.

- `grpo.py`: what each loss of the online RL trainers (GRPO, RLOO) averages over;
- `generating.py`: trainers that generate or rebuild their batch inside a micro-step (A*-PO, SDPO, Online DPO, GOLD,
  IW-OPD, GKD);
- `loss_terms.py`: losses of several terms with different denominators, each weighted by its own count;
- `dpo_sorted.py`: DPO's `aot` losses, sorted over the window;
- `grpo_entropy.py`: GRPO's `top_entropy_quantile`, the window's quantile;
- `kto.py`: KTO's KL baseline over the window.
"""
