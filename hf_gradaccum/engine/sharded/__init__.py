"""Gradients held as `DTensor` shards, chosen once when a [`GradientAccumulator`] is built on a model whose parameters
`fully_shard` or a tensor-parallel plan made `DTensor`s.

May import: the rest of `engine/` only.

- `buffer_choice.py`: which buffers a model gets (replicated, offloaded, FSDP2 or tensor-parallel shards), and the
  engines that keep gradients themselves (DeepSpeed, FSDP1), refused;
- `fsdp2_buffers.py`: the sharded fp32 buffers (each rank holds its shard, filled after FSDP2's reduce-scatter), the
  item weighting that must happen before that reduce-scatter, and the refusals of what it could not reduce;
- `fsdp2_schedule.py`: when FSDP2 reduce-scatters during a window (every micro-batch, or once per window);
- `fsdp2_checkpoint.py`: mid-window state through `torch.distributed.checkpoint`, one shard per rank;
- `tensor_parallel.py`: tensor-parallel parameters without FSDP2 (local shards in fp32, reduced once per window over
  the data-parallel group only, since a tensor-parallel group shares its batch).

Models without `DTensor` parameters never reach this folder beyond the check that they have none.
"""
