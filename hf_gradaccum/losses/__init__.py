"""What a loss divides by, for transformers models and the losses users write: the rule each micro-batch is
weighted by, how it is measured on the first window, where items are counted, and what to do when nothing divides.

May import: `engine/`, `helpers/`, `verification/`, `config/`, `distributed/`.

- `rule.py`: `TrainerLossRule`, the rule `GradAccumTrainer` settles on the first window (or stops);
- `plain_loop.py`: `hf_gradaccum.GradientAccumulator`, the engine's accumulator with the same rule for plain loops;
- `probe_gradients.py`: the gradient half of that measurement;
- `model_losses.py`: models' own losses that need more than one count (detection, several terms, contrastive);
- `counting.py`: counting a micro-batch's items on the inputs its loss sees;
- `model_inspection.py`: what a model is (transformers' registries on top of the engine's duck typing);
- `composed_class.py`, `composition_error.py`: which library trainer is composed, and the error a refusal raises;
- `coupled.py`, `moe.py`: the Trainer half of the two window modes (in-batch negatives, MoE load balancing);
- `accumulation_check.py`: `verify_accumulation`, the split-invariance check on a training window.
"""

from ..config.compat import check_transformers_version

check_transformers_version()
