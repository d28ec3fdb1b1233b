"""Tensor parallelism and HSDP as the Trainer sets them up, for `GradAccumTrainer`.

A model loaded with `from_pretrained(..., tp_plan="auto")` or `distributed_config=DistributedConfig(tp_size=...,
fsdp_size=..., dp_replicate_size=...)` arrives sharded (tensor-parallel `DTensor`s, FSDP2 on the data-parallel mesh
dimensions); the Trainer then gives Accelerate a `ParallelismConfig` whose device mesh decides which ranks get the
same batch (a tensor-parallel group) and which get different ones (its flattened `dp` dimension). The accumulator
sums each window's items and replicated gradients over that `dp` group alone (`engine/sharded/tensor_parallel.py`). HSDP
needs nothing more than FSDP2 does: every rank sees its own batch, and FSDP2's reduce-scatter within a replica and
all-reduce across replicas both sum once their divide factor is 1.

For a model FSDP2-sharded at load time the Trainer turns FSDP2's gradient sync off around every micro-batch but a
window's last (`set_requires_gradient_sync(False)`, with HSDP `set_requires_all_reduce(False)`), as Accelerate's
`no_sync` does for its FSDP2 plugin; the accumulator sets it per module just before each backward, following its
`fsdp_reduce_schedule` (`engine/sharded/fsdp2_schedule.py`), so both routes reduce the same way.

Context and sequence parallelism split one sequence's tokens over ranks; how their loss and items would be weighted
has not been checked, so they are refused before training. So are trainable parameters added after load-time FSDP2
sharding (a PEFT adapter on a `DistributedConfig(fsdp_size=...)` model): attach the adapter first and let Accelerate's
FSDP2 plugin shard the PEFT model.
"""

from __future__ import annotations

from typing import Any

from ..engine.sharded.tensor_parallel import has_tensor_parallel_parameters


def sharded_at_load_time(trainer: Any) -> bool:
    """Whether `trainer`'s model was sharded by `from_pretrained(..., distributed_config=...)` (or `tp_plan=`)."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def check_trainer_parallelism(trainer: Any) -> None:
    """
    Refuse context and sequence parallelism (Accelerate's `ParallelismConfig(cp_size=...)` / `sp_size=...`), and
    trainable parameters FSDP2 did not shard on a model sharded at load time
    ([`refuse_adapters_after_load_time_fsdp2`]), with the reason and what to use instead.

    Example:

    ```python
    >>> from hf_gradaccum.distributed.parallelism import check_trainer_parallelism
    >>> check_trainer_parallelism(trainer)  # doctest: +SKIP  (called by GradAccumTrainer.__init__)
    ```
    """
    refuse_adapters_after_load_time_fsdp2(trainer)
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None:
        return
    for name in ("cp", "sp"):
        if getattr(config, f"{name}_size", 1) > 1:
            raise ValueError(
                f"GradAccumTrainer does not support `ParallelismConfig({name}_size={getattr(config, f'{name}_size')})`: "
                "context and sequence parallelism split each sequence's tokens over ranks, and how their micro-batch "
                "losses are weighted has not been verified against the large batch. Use `cp_size=1` and `sp_size=1` "
                "(data, tensor and HSDP parallelism are supported), or the stock Trainer."
            )


def refuse_adapters_after_load_time_fsdp2(trainer: Any) -> None:
    """
    Refuse trainable parameters that `fully_shard` did not shard on a model FSDP2-sharded at load time
    (`DistributedConfig(fsdp_size=..., dp_replicate_size=...)`): a PEFT adapter attached after `from_pretrained`.
    PEFT sizes each adapter from the sharded base layer's local shard (a `lora_B` of 8 rows for a 16-row projection on
    2 shards; measured), so the forward fails; and the Trainer averages such plain parameters' gradients over all
    ranks in a hook of its own, outside the accumulator's item weighting, which nothing here has verified exact.
    Refused at construction rather than left to fail (or not) in the first forward. Tensor parallelism without FSDP2
    is not refused: PEFT lays the adapters out on the `tp` mesh, and that trains the large batch (measured).
    """
    from ..engine.sharded.fsdp2_buffers import fsdp2_modules, is_dtensor

    if not sharded_at_load_time(trainer) or not fsdp2_modules(trainer.model):
        return
    plain = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not is_dtensor(p)]
    if plain:
        raise ValueError(
            f"GradAccumTrainer does not support trainable parameters added after `from_pretrained(..., "
            f"distributed_config=...)` sharded the model with FSDP2: {plain[:3]}{' ...' if len(plain) > 3 else ''}. "
            "`fully_shard` did not shard them (PEFT sizes such adapters from each rank's local shard, so the forward "
            "fails, and their gradients would be averaged outside the accumulator). Attach the adapter before "
            "sharding: load without `distributed_config`, call `get_peft_model`, and shard with Accelerate's FSDP2 "
            "plugin (`fsdp_version: 2`, with `ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)` for HSDP)."
        )


def data_parallel_group(trainer: Any) -> Any | None:
    """
    The process group over which `trainer`'s accumulator sums each window: under tensor parallelism, the ranks of
    Accelerate's device mesh that see different batches (its flattened `dp` dimension); `None` otherwise (every rank;
    with tensor parallelism alone, the engine sees that no rank has a data-parallel peer).

    Example:

    ```python
    >>> from hf_gradaccum.distributed.parallelism import data_parallel_group
    >>> data_parallel_group(trainer)  # doctest: +SKIP  (a ProcessGroup under tp_size x fsdp_size)
    ```
    """
    if not has_tensor_parallel_parameters(list(trainer.model.parameters())):
        return None
    config = getattr(trainer.accelerator, "parallelism_config", None)
    mesh = getattr(trainer.accelerator, "torch_device_mesh", None)
    if config is None or mesh is None or not config.dp_dim_names:
        return None
    return mesh["dp"].get_group()
