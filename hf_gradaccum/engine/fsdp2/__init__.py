"""The FSDP2 strategy of the engine, chosen once when a [`GradientAccumulator`] is built on a model whose parameters
`fully_shard` made `DTensor`s:

- `buffers.py`: the sharded fp32 buffers (each rank holds its shard, filled after FSDP2's reduce-scatter), the item
  weighting that must happen before that reduce-scatter, and the refusals of what it could not reduce;
- `schedule.py`: when FSDP2 reduce-scatters during a window (every micro-batch, or once per window);
- `checkpoint.py`: mid-window state through `torch.distributed.checkpoint`, one shard per rank.

Models without `DTensor` parameters never reach this package beyond the check that they have none.
"""
