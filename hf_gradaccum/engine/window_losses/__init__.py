"""Losses that are statistics of the whole window rather than means over independent items: the torch half of the
two window modes.

May import: the rest of `engine/` only.

- `coupled.py`: gradient caching for a loss over the whole window (in-batch negatives): every representation of the
  window first, then each micro-batch's share of the window loss;
- `grouped_coupled.py`: one coupled loss per group of rows (a dataset per loss);
- `moe_balance.py`: the window's exact MoE router statistics and the load-balancing term built from them.

Their Trainer half is `losses/coupled.py` and `losses/moe.py`.
"""
