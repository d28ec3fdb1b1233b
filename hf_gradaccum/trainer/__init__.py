"""`GradAccumTrainer`, the transformers `Trainer` whose accumulation is exactly the large-batch update, and the steps
it is made of: a thin adapter over the engine, which reaches the other libraries' trainers through
`integrations/registry.py` only.

May import: `engine/`, `helpers/`, `verification/`, `config/`, `distributed/`, `losses/`, `integrations/`.

- `trainer.py`: `GradAccumTrainer`, the methods the Trainer's loop calls;
- `window_start.py`: what starts with each prefetched window;
- `micro_batch.py`: one micro-batch through the parents' own `training_step`, read top-down;
- `item_counting.py`: the default count of a micro-batch's items;
- `loss_handover.py`: where the accumulator's weight reaches the loss (`Accelerator.backward`, the window's scaler);
- `window_end.py`: a window that ends inside the Trainer's gradient clipping;
- `step_gating.py`: what a skipped window does to the scheduler and step counters;
- `out_of_memory.py`: `auto_find_batch_size` without changing the effective batch;
- `accumulator_state.py`, `atomic_checkpoints.py`: the accumulator's state in checkpoints, and atomic saves;
- `effective_batch.py`: `EffectiveBatchCallback`, what was tuned at one batch carried to the effective batch.
"""

from ..config.compat import check_transformers_version

check_transformers_version()
