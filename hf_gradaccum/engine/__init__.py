"""The engine: exact gradient accumulation in plain PyTorch. It knows no model class, no Trainer and no transformers.

May import: nothing else of this package (torch and `accelerate.utils` only).

- `accumulator.py`: `GradientAccumulator`, one window from `begin_micro_batch` to `finish_window` (backward, fold,
  end the window, step);
- `buffers.py`: flat fp32 buffers with one view per parameter, filled by post-accumulate-grad hooks. Everything that
  differs between these replicated buffers and the sharded ones (where the item weight is applied, how ranks agree
  on a micro-batch, who reduces) is a method of the buffers, so the accumulator has one path;
- `in_place.py`: the path without buffers (the weighted loss accumulates into `.grad` itself);
- `offload.py`: the buffers in pinned host memory (`offload_accumulation_buffer=True`);
- `window.py`: per-window bookkeeping and the `WindowResult` it ends with;
- `recompute.py`: fp16 overflow handling that redoes only the overflowing micro-batch;
- `reduction.py`: what the ranks exchange at the end of a window;
- `items.py`: counting a micro-batch's items (labels, rows);
- `loss_normalisation.py`: what a loss divides by, measured from loss values on cuts of a window;
- `model_inspection.py`: whether a model's loss shifts its labels (causal LM), by duck typing;
- `loss_scaling.py`, `oom_retry.py`, `validation.py`, `rng.py` (capture and restore every random generator),
  `process_exit.py` (a clean exit for finished gloo scripts): one concern each;
- `sharded/`: gradients held as `DTensor` shards (FSDP2, tensor parallelism) and the choice of buffers;
- `window_losses/`: losses over the whole window (gradient caching, the window's MoE router statistics);
- `run_batch/`: the run's batch laid out on any number of processes, and its sampler.
"""
