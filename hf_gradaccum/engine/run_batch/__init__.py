"""The run's batch on any layout: one global batch split into every rank's micro-batches, the same windows whatever
the number of processes, and a resume on another layout.

May import: the rest of `engine/` only.

- `layout.py`: `RunBatchLayout`, each rank's share of a window and the micro-batches it runs;
- `sampler.py`: `RunBatchSampler`, the batch sampler that yields those micro-batches in the run's order.

The Trainer half (the loader, the checks at resume) is `distributed/run_batch.py`. The names of `layout.py` are also
importable from here, where they lived before this folder existed (`hf_gradaccum.engine.run_batch`).
"""

from .layout import RunBatchLayout, run_batch_accumulation_steps, window_rows

__all__ = ["RunBatchLayout", "run_batch_accumulation_steps", "window_rows"]
