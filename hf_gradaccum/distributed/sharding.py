"""Which distributed engines `GradAccumTrainer` runs under, and how it sets up FSDP2.

DDP and FSDP2 leave the gradients to hooks the accumulator can sit in: DDP through `no_sync`, FSDP2 through the
post-accumulate-grad hook on each sharded parameter after its reduce-scatter (engine/sharded/fsdp2_buffers.py). FSDP1
accumulates and reduces flat-parameter gradients inside its own engine, so it is refused. DeepSpeed also owns its
gradients; there the window is made exact through the loss handed to its engine instead (distributed/deepspeed.py). For
FSDP2 through Accelerate's plugin (`fsdp_version: 2`) the reduction dtype is raised to fp32 before the model is
sharded: Accelerate's `bf16`/`fp16` policy reduce-scatters in the compute dtype, which would round every micro-batch's
gradient before it reaches the fp32 buffer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..config.arguments import gradaccum_option
from ..engine.sharded.fsdp2_buffers import fsdp2_modules, is_dtensor
from .deepspeed import check_deepspeed, deepspeed_enabled
from .parallelism import check_trainer_parallelism, sharded_at_load_time

logger = logging.getLogger(__name__)

LOW_PRECISION = (torch.float16, torch.bfloat16)


def trainer_shards_gradients(trainer: Any) -> bool:
    """Whether `trainer`'s model is (or will be, once Accelerate prepares it) sharded with FSDP2, so that its
    gradients are summed over ranks by a reduce-scatter before the accumulator sees them."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if trainer.is_fsdp_enabled and plugin is not None and getattr(plugin, "fsdp_version", 1) == 2:
        return True
    return any(is_dtensor(p) for p in trainer.model.parameters())


def check_trainer_engine(trainer: Any) -> None:
    """
    Under DeepSpeed, refuse what cannot run there and make it accumulate in fp32 (`check_deepspeed`). Refuse FSDP1
    with an error that says what to use; for FSDP2, make the reduce-scatter fp32 and refuse
    what does not work sharded yet. Warn when FSDP was asked for in the arguments but Accelerate did not set it up
    (it does so only for GPU-type devices), so the run is DDP.

    Example:

    ```python
    >>> from hf_gradaccum.distributed.sharding import check_trainer_engine
    >>> check_trainer_engine(trainer)  # doctest: +SKIP  (called by GradAccumTrainer.__init__)
    ```
    """
    if deepspeed_enabled(trainer):
        _check_reduce_schedule(trainer.args, fsdp2=False)
        check_deepspeed(trainer)
        return
    check_trainer_parallelism(trainer)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    fsdp2 = trainer.is_fsdp_enabled and plugin is not None and getattr(plugin, "fsdp_version", 1) == 2
    # A model FSDP2-sharded at load time (`DistributedConfig`) takes the same schedules as Accelerate's plugin.
    _check_reduce_schedule(
        trainer.args, fsdp2 or (sharded_at_load_time(trainer) and bool(fsdp2_modules(trainer.model)))
    )
    if trainer_shards_gradients(trainer):
        _refuse_what_sharding_cannot_run(trainer)
    if not trainer.is_fsdp_enabled or plugin is None:
        if getattr(trainer.args, "fsdp", None):
            logger.warning(
                "`fsdp=%s` was requested but Accelerate did not set FSDP up (distributed type %s; Accelerate shards "
                "only on GPU-type devices): this run replicates the model on every rank (DDP). Accumulation stays "
                "exact; memory is not sharded.",
                trainer.args.fsdp,
                trainer.accelerator.distributed_type,
            )
        return
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "GradAccumTrainer supports FSDP2 only (`fsdp_version: 2` in the Accelerate config, or "
            "`fsdp_config={'version': 2}` in the arguments); FSDP1 (`FullyShardedDataParallel`) accumulates and "
            "reduces flat-parameter gradients inside its own engine, past the accumulator."
        )
    _reduce_in_fp32(plugin)


def _refuse_what_sharding_cannot_run(trainer: Any) -> None:
    """FSDP2, HSDP and tensor parallelism (`DTensor` parameters, however they were sharded): refuse the split-
    invariance check and the multi-process out-of-memory retry."""
    if gradaccum_option(trainer.args, "verify_accumulation") != "off":
        raise ValueError(
            "`verify_accumulation` is not supported under FSDP2 or tensor parallelism (the check differentiates a "
            "second copy of the parameters, which they shard). Set `verify_accumulation='off'` and check the model "
            "once on one process with `hf-gradaccum verify` or `verify_split_invariance`."
        )
    if trainer.args.auto_find_batch_size and trainer.args.world_size > 1:
        raise ValueError(
            "`auto_find_batch_size=True` is not supported under FSDP2 (or tensor parallelism) with more than one "
            "process: the out-of-memory retry redoes a window on the rank that ran out of memory alone, but every "
            "sharded forward and backward is a collective, so the ranks would fall out of step. Set "
            "`auto_find_batch_size=False` and choose `per_device_train_batch_size` (hf_gradaccum.plan_accumulation "
            "helps), or use DDP."
        )


def _check_reduce_schedule(args: Any, fsdp2: bool) -> None:
    """`fsdp_reduce_schedule="once_per_window"` needs FSDP2 and cannot take back an fp16 overflow: refuse both before
    training instead of when the accumulator is built at the first step."""
    if gradaccum_option(args, "fsdp_reduce_schedule") != "once_per_window":
        return
    if not fsdp2:
        raise ValueError(
            "`fsdp_reduce_schedule='once_per_window'` needs FSDP2 (`fsdp_version: 2` with Accelerate's FSDP plugin, "
            "which Accelerate sets up only on GPUs); this run is not sharded. Use `fsdp_reduce_schedule="
            "'every_micro_batch'` (allowed values: 'every_micro_batch', 'once_per_window')."
        )
    if args.fp16 and gradaccum_option(args, "overflow_policy") == "recompute":
        raise ValueError(
            "`fsdp_reduce_schedule='once_per_window'` with fp16 needs `overflow_policy='skip'`: FSDP2 sums the "
            "window's unsharded gradients itself, so an overflowing micro-batch cannot be recomputed alone. Use "
            "`overflow_policy='skip'` or `fsdp_reduce_schedule='every_micro_batch'`."
        )


def _reduce_in_fp32(plugin: Any) -> None:
    """Raise the plugin's `MixedPrecisionPolicy.reduce_dtype` to fp32 when FSDP2 would otherwise reduce-scatter each
    micro-batch in bf16/fp16 (the policy Accelerate builds from `mixed_precision`)."""
    policy = plugin.mixed_precision_policy
    if policy is None:
        return
    reduce_dtype = policy.reduce_dtype or policy.param_dtype
    if reduce_dtype in LOW_PRECISION:
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
        logger.warning(
            "GradAccumTrainer: FSDP2 reduce_dtype %s -> torch.float32, so each micro-batch's reduce-scatter is summed "
            "into the fp32 accumulation buffer without rounding (parameters and compute stay in %s).",
            reduce_dtype,
            policy.param_dtype,
        )
