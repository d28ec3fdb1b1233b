"""Opt-in batch-size policies applied once when the trainer is built, never by overriding `train()`:
learning-rate scaling (`lr_scaling_rule`) and BatchNorm momentum correction (`batchnorm_momentum_correction`).

Both are plain helpers for loops without a Trainer: [`~hf_gradaccum.helpers.lr_scaling.scale_learning_rate`] and
[`~hf_gradaccum.helpers.normalization.apply_accumulation_bn_momentum`].
"""

from __future__ import annotations

import logging
from typing import Any

from ..helpers.lr_scaling import recommended_warmup_steps, scale_learning_rate
from ..helpers.normalization import apply_accumulation_bn_momentum
from .arguments import gradaccum_option

logger = logging.getLogger(__name__)


def apply_batch_policies(trainer: Any) -> None:
    """Scale `trainer.args.learning_rate` and correct BatchNorm momentum when (and only when) the options ask for it.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.batch_policies import apply_batch_policies  # called by GradAccumTrainer.__init__
    ```
    """
    scale_trainer_learning_rate(trainer)
    if gradaccum_option(trainer.args, "batchnorm_momentum_correction") and trainer.model is not None:
        apply_accumulation_bn_momentum(trainer.model, trainer.args.gradient_accumulation_steps)


def scale_trainer_learning_rate(trainer: Any) -> None:
    """`lr_scaling_rule`: rescale `args.learning_rate` from `reference_batch_size` to the effective batch (before the
    optimizer and scheduler are created, so both see the scaled rate)."""
    args = trainer.args
    rule = gradaccum_option(args, "lr_scaling_rule")
    if rule == "none":
        return
    base = args.learning_rate
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    reference = gradaccum_option(args, "reference_batch_size")
    args.learning_rate = scale_learning_rate(base, base_batch_size=reference, new_batch_size=effective, rule=rule)
    trainer._base_learning_rate = base
    logger.warning(
        "lr_scaling_rule=%s: learning rate %g (tuned at batch %d) -> %g at effective batch %d.",
        rule,
        base,
        reference,
        args.learning_rate,
        effective,
    )
    if rule == "linear" and effective > reference and not (args.warmup_steps or getattr(args, "warmup_ratio", 0)):
        dataset = trainer.train_dataset
        steps_per_epoch = (
            max(1, len(dataset) // effective) if dataset is not None and hasattr(dataset, "__len__") else 1
        )
        logger.warning(
            "Linear LR scaling by %.3gx without warmup is unstable early in training (Goyal et al. 2017); "
            "consider `warmup_steps=%d`.",
            effective / reference,
            recommended_warmup_steps(
                base_batch_size=reference, new_batch_size=effective, steps_per_epoch=steps_per_epoch
            ),
        )
