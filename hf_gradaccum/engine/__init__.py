"""The engine: exact gradient accumulation in plain PyTorch (no transformers).

- `accumulator.py`: `GradientAccumulator`, the main loop (backward, fold, finish the window, step);
- `buffers.py`: flat fp32 buffers with one view per parameter, filled by post-accumulate-grad hooks. Everything that
  differs between these replicated buffers and FSDP2's sharded ones (where the item weight is applied, how ranks
  agree on a micro-batch, who reduces) is a method of the buffers, so the accumulator has one path;
- `offload.py`: the same buffers in pinned host memory (`offload_accumulation_buffer=True`), filled by copies on a
  side stream and a host thread, so the GPU holds about one parameter's gradient at a time;
- `fsdp2/`: the FSDP2 strategy: the sharded buffers, when FSDP2 reduce-scatters during a window, and mid-window
  checkpoints through `torch.distributed.checkpoint`;
- `tensor_parallel.py`: tensor-parallel `DTensor` parameters without FSDP2 (local shards in fp32, reduced once per
  window over the data-parallel group only, since a tensor-parallel group shares its batch);
- `model_inspection.py`: whether a model's loss shifts its labels (causal LM), by duck typing, for `batch=` counting;
- `window.py`: per-window bookkeeping and the `WindowResult` it ends with;
- `recompute.py`: fp16 overflow handling that redoes only the overflowing micro-batch;
- `reduction.py`: what the ranks exchange at the end of a window;
- `coupled.py` (gradient caching for losses over the whole window) and `moe_balance.py` (the window's exact MoE
  router statistics): the torch half of the two loss modes; their Trainer half is `adapters/coupled.py` and
  `adapters/moe.py`;
- `loss_scaling.py`, `items.py`, `oom_retry.py`, `validation.py`, `rng.py` (capture and restore every random
  generator), `process_exit.py` (a clean exit for finished gloo scripts): one concern each.
"""
