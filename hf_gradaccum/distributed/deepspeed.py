"""How `GradAccumTrainer` makes a window exact under DeepSpeed ZeRO 1, 2 and 3: through the loss handed to DeepSpeed.

DeepSpeed owns the gradient buffers, their reduction over ranks and its loss scaler, so the accumulator's hooks are not
installed. What this module controls is the loss each micro-batch back-propagates. The large batch's gradient is
`sum_k n_k * grad(mean loss_k) / N`, over every micro-batch `k` of the window on every rank (`n_k` its items, `N` the
window's items summed over ranks). DeepSpeed averages the gradients over its data-parallel ranks (a division by
`dp_world_size`), and divides each loss by its accumulation steps unless `scale_wrt_gas=False` (the Trainer passes
that). So each micro-batch hands DeepSpeed `mean loss_k * n_k / N * dp_world_size` (times the accumulation steps when
DeepSpeed divides by them): the sum DeepSpeed forms is then the large batch's gradient. `N` is known once
`get_batch_samples` has prefetched the window: one all-reduce of the local count per window.

The accumulation dtype is DeepSpeed's: under bf16/fp16 its `data_types.grad_accum_dtype` is set to fp32 (or refused if
the configuration lowers it), and `communication_data_type` to fp32 where unset, so that no micro-batch's gradient is
rounded to the compute dtype before it is summed. What does not work through DeepSpeed's engine is refused in
`GradAccumTrainer.__init__`, before any work, with the reason and the fix (`check_deepspeed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..config.arguments import gradaccum_option

logger = logging.getLogger(__name__)

LOW_PRECISION_ACCUMULATION = ("fp16", "float16", "half", "bf16", "bfloat16")


def deepspeed_enabled(trainer: Any) -> bool:
    """
    Whether `trainer` trains under DeepSpeed (`TrainingArguments(deepspeed=...)` or an Accelerate DeepSpeed config).

    Example:

    ```python
    >>> from hf_gradaccum.distributed.deepspeed import deepspeed_enabled
    >>> deepspeed_enabled(trainer)  # doctest: +SKIP
    True
    ```
    """
    return bool(getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer.args, "deepspeed", None))


def deepspeed_config(trainer: Any) -> dict[str, Any]:
    """
    The DeepSpeed configuration dict the engine will be built from (with the Trainer's "auto" values filled in).

    Example:

    ```python
    >>> from hf_gradaccum.distributed.deepspeed import deepspeed_config
    >>> deepspeed_config(trainer)["zero_optimization"]["stage"]  # doctest: +SKIP
    2
    ```
    """
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and isinstance(getattr(plugin, "deepspeed_config", None), dict):
        return plugin.deepspeed_config
    hf_config = getattr(trainer.args, "hf_deepspeed_config", None)
    return hf_config.config if hf_config is not None else {}


def check_deepspeed(trainer: Any) -> None:
    """
    Refuse, before any work, what cannot be exact or cannot run under DeepSpeed, with the reason and the fix; make
    DeepSpeed accumulate and reduce in fp32 under bf16/fp16.

    Args:
        trainer ([`GradAccumTrainer`]): a trainer whose arguments or Accelerate config enable DeepSpeed.

    Example:

    ```python
    >>> from hf_gradaccum.distributed.deepspeed import check_deepspeed
    >>> # called by GradAccumTrainer.__init__ under DeepSpeed
    >>> check_deepspeed(trainer)  # doctest: +SKIP
    ```
    """
    args = trainer.args
    refusals = [
        (
            trainer.coupled_mode is not None,
            "`coupled_loss`",
            "gradient caching runs two passes per window with its own backward, which DeepSpeed's engine would "
            "count as micro-batches of their own",
            "train the coupled loss under DDP or FSDP2",
        ),
        (
            trainer.moe_mode is not None,
            "`moe_load_balance='window'`",
            "the window's router statistics come from an extra forward pass outside DeepSpeed's engine",
            "use `moe_load_balance='micro_batch'` under DeepSpeed, or DDP/FSDP2 for the exact router term",
        ),
        (
            args.auto_find_batch_size,
            "`auto_find_batch_size=True`",
            "the out-of-memory retry redoes a window from its first micro-batch, but DeepSpeed has already summed "
            "the interrupted micro-batches into its own gradient partitions, which cannot be taken back",
            "set `auto_find_batch_size=False` and choose `per_device_train_batch_size` "
            "(hf_gradaccum.plan_accumulation helps), or offload with DeepSpeed's `offload_optimizer`/`offload_param`",
        ),
        (
            gradaccum_option(args, "offload_accumulation_buffer"),
            "`offload_accumulation_buffer=True`",
            "there is no accumulation buffer of this project under DeepSpeed (DeepSpeed keeps the gradients)",
            "use DeepSpeed's `zero_optimization.offload_optimizer: {device: cpu}` instead",
        ),
        (
            gradaccum_option(args, "verify_accumulation") != "off",
            "`verify_accumulation`",
            "the split-invariance check differentiates the model outside DeepSpeed's engine: under ZeRO-3 its "
            "parameters are partitioned (empty on each rank), and under ZeRO-1/2 DeepSpeed's gradient hooks would "
            "take the check's gradients as a micro-batch",
            "set `verify_accumulation='off'` and check the model once on one process without DeepSpeed "
            "(`hf-gradaccum verify` or `verify_split_invariance`)",
        ),
        (
            bool(getattr(trainer, "_unknown_composition", None)),
            f"composing with {getattr(trainer, '_unknown_composition', None)}",
            "the composition registry does not know how its loss accumulates, and the split-invariance check that "
            "would decide it cannot run under DeepSpeed (see `verify_accumulation`)",
            "register it with `register_composition`, or set `check_unknown_compositions=False` to train unchecked",
        ),
        (
            getattr(trainer, "_generation_accumulation", None) is not None
            or getattr(trainer, "_kto_baseline", None) is not None,
            f"composing with {type(trainer).__name__}'s online-generation or KL-baseline losses",
            "their items or baseline are computed by extra passes outside DeepSpeed's engine",
            "train these trainers under DDP or FSDP2",
        ),
        (
            gradaccum_option(args, "bf16_loss_scaling"),
            "`bf16_loss_scaling=True`",
            "DeepSpeed's bf16 mode has no loss scaler, and this project's scaler is not used under DeepSpeed",
            "set `bf16_loss_scaling=False` (bf16 has fp32's exponent range)",
        ),
        (
            gradaccum_option(args, "take_back_skipped_steps"),
            "`take_back_skipped_steps=True`",
            "DeepSpeed decides itself whether a step is skipped (fp16 overflow) and advances its own counters",
            "set `take_back_skipped_steps=False`",
        ),
        (
            _model_parallel(trainer),
            "sequence or tensor parallelism (Ulysses, AutoTP)",
            "ranks of one model-parallel group see the same samples, so the window's items summed over all processes "
            "would count them once per rank",
            "train data-parallel only (ZeRO 1/2/3), or use the stock Trainer for Ulysses / AutoTP",
        ),
    ]
    for refused, what, why, fix in refusals:
        if refused:
            raise ValueError(f"GradAccumTrainer cannot use {what} under DeepSpeed: {why}. Fix: {fix}.")
    config = deepspeed_config(trainer)
    fp16 = bool(args.fp16 or config.get("fp16", {}).get("enabled") is True)
    if fp16:
        _check_fp16(args)
    bf16 = bool(args.bf16 or config.get("bf16", {}).get("enabled") is True)
    if fp16 or bf16:
        accumulate_in_fp32(config)


def _model_parallel(trainer: Any) -> bool:
    """Whether DeepSpeed also splits the model over ranks (Ulysses sequence parallelism, AutoTP)."""
    config = deepspeed_config(trainer)
    autotp = config.get("tensor_parallel", {}).get("autotp_size", 1)
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    ulysses = bool(
        parallelism is not None
        and getattr(parallelism, "sp_backend", None) == "deepspeed"
        and getattr(parallelism, "sp_enabled", False)
    )
    return (
        ulysses
        or (isinstance(autotp, int) and autotp > 1)
        or config.get("sequence_parallel_size", 1) not in (1, "auto")
    )


def _check_fp16(args: Any) -> None:
    """fp16 under DeepSpeed: its loss scaler skips the whole window after an overflow (this project's per-micro-batch
    recompute cannot run inside DeepSpeed's engine). Allowed only when the arguments say so."""
    if gradaccum_option(args, "overflow_policy") != "skip":
        raise ValueError(
            "GradAccumTrainer under DeepSpeed with fp16: DeepSpeed's own loss scaler decides overflows, and after one "
            "it skips the whole window's update (`overflow_policy='recompute'`, the default, would redo only the "
            "overflowing micro-batch; that cannot run inside DeepSpeed's engine). Set `overflow_policy='skip'` to "
            "accept whole-window skips, or train in bf16 (allowed values of `overflow_policy`: 'recompute', 'skip')."
        )
    logger.warning(
        "GradAccumTrainer under DeepSpeed fp16: an overflow in any micro-batch skips the whole window's update "
        "(DeepSpeed's loss scaler; `overflow_policy='skip'`). Without overflows each update is the large batch's."
    )


def accumulate_in_fp32(config: dict[str, Any]) -> None:
    """
    Make DeepSpeed accumulate (`data_types.grad_accum_dtype`) and reduce (`communication_data_type`) gradients in fp32
    when the configuration leaves them unset; refuse a configuration that asks for a lower accumulation dtype.

    Args:
        config (`dict`): the DeepSpeed configuration, changed in place (before DeepSpeed builds its engine).

    Example:

    ```python
    >>> from hf_gradaccum.distributed.deepspeed import accumulate_in_fp32
    >>> config = {"bf16": {"enabled": True}}
    >>> accumulate_in_fp32(config)
    >>> config["data_types"], config["communication_data_type"]
    ({'grad_accum_dtype': 'fp32'}, 'fp32')
    ```
    """
    data_types = config.setdefault("data_types", {})
    accum = data_types.get("grad_accum_dtype")
    if accum in (None, "auto"):
        data_types["grad_accum_dtype"] = "fp32"
    elif str(accum).lower() in LOW_PRECISION_ACCUMULATION:
        raise ValueError(
            f"The DeepSpeed config sets `data_types.grad_accum_dtype: {accum}`: every micro-batch's gradient would be "
            "rounded to it before the window's sum, so the update is not the large batch's. Set it to 'fp32' or "
            "remove it (GradAccumTrainer then sets 'fp32')."
        )
    if config.get("communication_data_type") in (None, "auto"):
        config["communication_data_type"] = "fp32"
    elif str(config["communication_data_type"]).lower() in LOW_PRECISION_ACCUMULATION:
        logger.warning(
            "DeepSpeed `communication_data_type: %s`: each micro-batch's gradient is reduced over ranks in it before "
            "it is summed in fp32 (fewer bytes, rounded). Remove it for fp32 reductions.",
            config["communication_data_type"],
        )


class DeepSpeedWindow:
    """
    The weight of each micro-batch's loss under DeepSpeed: its items over the window's items summed over ranks, with
    DeepSpeed's own averaging over ranks (and division by its accumulation steps, when it divides) undone.

    Args:
        trainer ([`GradAccumTrainer`]): the trainer; its Accelerator hands the loss to DeepSpeed.

    Example:

    ```python
    >>> from hf_gradaccum.distributed.deepspeed import DeepSpeedWindow
    >>> # GradAccumTrainer builds it under DeepSpeed; one all-reduce per window:
    >>> window = DeepSpeedWindow(trainer)  # doctest: +SKIP
    >>> window.window_prefetched(local_items=37.0)  # doctest: +SKIP
    ```
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.window_items: float | None = None
        self._micro_items: float | None = None
        self._handed_over = 0

    def window_prefetched(self, local_items: float | None) -> None:
        """Sum the window's item count over ranks (every rank calls this once per window: a collective)."""
        if local_items is None:
            raise ValueError(
                "GradAccumTrainer under DeepSpeed could not count this window's items (see "
                "`count_micro_batch_items`): the loss handed to DeepSpeed needs them. Override "
                "`count_micro_batch_items` to return what your loss divides by."
            )
        accelerator = self._trainer.accelerator
        count = torch.tensor(float(local_items), dtype=torch.float64, device=self._trainer.args.device)
        self.window_items = (
            float(accelerator.reduce(count, reduction="sum")) if accelerator.num_processes > 1 else float(count)
        )

    def training_step(self, items: float, parent_step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run the parents' `training_step` (`parent_step`) on one micro-batch of `items` items, weighting the loss
        Accelerate hands to DeepSpeed. Returns the parent's detached mean loss."""
        if self.window_items is None:
            raise RuntimeError(
                "GradAccumTrainer under DeepSpeed trains inside `Trainer.train()` only: the window's items are counted "
                "when it is prefetched (`get_batch_samples`)."
            )
        self._install()
        self._micro_items, self._handed_over = float(items), 0
        try:
            loss = parent_step()
        finally:
            self._micro_items = None
        if self._handed_over != 1:
            raise RuntimeError(
                f"The training_step of {type(self._trainer).__name__}'s parent classes handed {self._handed_over} "
                "losses to `accelerator.backward` for one micro-batch; under DeepSpeed GradAccumTrainer weights "
                "exactly one. Compose only with trainers whose training_step ends in `Trainer.training_step`."
            )
        return loss

    def _weighted(self, loss: torch.Tensor, engine: Any, scale_wrt_gas: bool) -> torch.Tensor:
        """`loss` as DeepSpeed must receive it for the window's sum to be the large batch's gradient."""
        self._handed_over += 1
        if self._micro_items is None:
            return loss  # a backward outside a micro-batch: left as it is
        factor = self._micro_items / self.window_items if self.window_items else 0.0
        factor *= engine.dp_world_size
        if scale_wrt_gas:
            factor *= engine.gradient_accumulation_steps()
        return loss * factor

    def _install(self) -> None:
        """Put the weighting between Accelerate and DeepSpeed's engine (once the Trainer has prepared the engine)."""
        accelerator = self._trainer.accelerator
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is None:
            raise RuntimeError("DeepSpeed is enabled but Accelerate has not prepared its engine.")
        if not isinstance(wrapped, _WeightedEngine) or wrapped.window is not self:
            accelerator.deepspeed_engine_wrapped = _WeightedEngine(wrapped, self)


class _WeightedEngine:
    """Accelerate's `DeepSpeedEngineWrapper` with each loss weighted before DeepSpeed's `backward`; everything else
    (its `engine`, `get_global_grad_norm`) is the wrapper's own."""

    def __init__(self, inner: Any, window: DeepSpeedWindow) -> None:
        self.inner = getattr(inner, "inner", inner)
        self.window = window

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        scale_wrt_gas = kwargs.get("scale_wrt_gas", True)
        weighted = self.window._weighted(loss, self.inner.engine, scale_wrt_gas)
        self.inner.backward(weighted, sync_gradients=sync_gradients, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
