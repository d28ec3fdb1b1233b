"""[`EffectiveBatchCallback`]: carry what was tuned at one batch size over to the effective batch, as a callback.

Two opt-in policies (off by default; `GradAccumTrainer` adds the callback from its `lr_scaling_rule`,
`reference_batch_size` and `batchnorm_momentum_correction` fields, and any `Trainer` takes it in `callbacks=`):
scaling the learning rate from the batch it was tuned at to `per_device_train_batch_size x gradient_accumulation_steps
x world_size`, and correcting BatchNorm momentum so running statistics decay per optimizer step. Both act in
`on_init_end`, before the optimizer and scheduler are created (they read `args.learning_rate` then). Loops without a
Trainer use the helpers they call: [`scale_learning_rate`] and [`apply_accumulation_bn_momentum`].
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..config.arguments import gradaccum_option
from ..helpers.lr_scaling import (
    check_lr_scaling_rule,
    effective_batch_size,
    recommended_warmup_steps,
    scale_learning_rate,
)
from ..helpers.normalization import apply_accumulation_bn_momentum

logger = logging.getLogger(__name__)


class EffectiveBatchCallback(TrainerCallback):
    """
    Scale the learning rate to the effective batch and correct BatchNorm momentum for accumulation, once, when the
    trainer is built.

    Args:
        lr_scaling_rule (`str`, *optional*, defaults to `"none"`): `"linear"` (SGD, with warmup), `"sqrt"` (Adam
            family) or `"none"`; see [`scale_learning_rate`].
        reference_batch_size (`int`, *optional*): the effective batch `learning_rate` was tuned at; required unless
            `lr_scaling_rule="none"`.
        batchnorm_momentum_correction (`bool`, *optional*, defaults to `False`): set every BatchNorm's momentum to
            `1 - (1 - m) ** (1 / gradient_accumulation_steps)`.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from hf_gradaccum import EffectiveBatchCallback
    >>> callback = EffectiveBatchCallback(lr_scaling_rule="sqrt", reference_batch_size=32)
    >>> trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])  # doctest: +SKIP
    >>> # args.learning_rate is now scaled from batch 32 to the effective batch
    ```
    """

    def __init__(
        self,
        lr_scaling_rule: str = "none",
        reference_batch_size: int | None = None,
        batchnorm_momentum_correction: bool = False,
    ) -> None:
        check_lr_scaling_rule(lr_scaling_rule, reference_batch_size)
        if not isinstance(batchnorm_momentum_correction, bool):
            raise ValueError(
                f"`batchnorm_momentum_correction` must be True or False, got {batchnorm_momentum_correction!r}."
            )
        self.lr_scaling_rule = lr_scaling_rule
        self.reference_batch_size = reference_batch_size
        self.batchnorm_momentum_correction = batchnorm_momentum_correction
        # The learning rate before scaling, per arguments object: scaling is applied once even if the event repeats.
        self.base_learning_rates: dict[int, float] = {}

    @classmethod
    def from_args(cls, args: TrainingArguments) -> EffectiveBatchCallback | None:
        """The callback the `GradAccumFields` of `args` ask for, or `None` when both policies are off."""
        rule = gradaccum_option(args, "lr_scaling_rule")
        batchnorm = gradaccum_option(args, "batchnorm_momentum_correction")
        if rule == "none" and not batchnorm:
            return None
        return cls(rule, gradaccum_option(args, "reference_batch_size"), batchnorm)

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self.lr_scaling_rule != "none" and id(args) not in self.base_learning_rates:
            base = args.learning_rate
            args.learning_rate = scale_learning_rate(
                base,
                base_batch_size=self.reference_batch_size,
                new_batch_size=_effective_batch(args),
                rule=self.lr_scaling_rule,
            )
            self.base_learning_rates[id(args)] = base
            logger.warning(
                "lr_scaling_rule=%s: learning rate %g (tuned at batch %d) -> %g at effective batch %d.",
                self.lr_scaling_rule,
                base,
                self.reference_batch_size,
                args.learning_rate,
                _effective_batch(args),
            )
        if self.batchnorm_momentum_correction and model is not None:
            apply_accumulation_bn_momentum(model, args.gradient_accumulation_steps)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        # Warned here rather than at construction: the dataloader's length gives the steps per epoch.
        effective = _effective_batch(args)
        if self.lr_scaling_rule != "linear" or effective <= self.reference_batch_size:
            return
        if args.warmup_steps or getattr(args, "warmup_ratio", 0):
            return
        batches = len(train_dataloader) if train_dataloader is not None and hasattr(train_dataloader, "__len__") else 0
        steps_per_epoch = max(1, batches // args.gradient_accumulation_steps)
        logger.warning(
            "Linear LR scaling by %.3gx without warmup is unstable early in training (Goyal et al. 2017); "
            "consider `warmup_steps=%d`.",
            effective / self.reference_batch_size,
            recommended_warmup_steps(
                base_batch_size=self.reference_batch_size, new_batch_size=effective, steps_per_epoch=steps_per_epoch
            ),
        )


def _effective_batch(args: TrainingArguments) -> int:
    return effective_batch_size(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size)
