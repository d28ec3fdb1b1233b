"""How `GradAccumTrainer` counts a micro-batch's items by default: the labels its loss is a mean over, as the loss
rule settled on the first window counts them, shifted where the model is a causal LM. A user's
`count_micro_batch_items` replaces all of this."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config.arguments import gradaccum_option
from ..engine.items import items_on_device
from ..losses.model_inspection import loss_shifts_labels

logger = logging.getLogger(__name__)


def labels_on_device(trainer: Any, inputs: dict[str, Any]) -> int | torch.Tensor:
    """`GradAccumTrainer`'s default count of a micro-batch's items: its labels as the settled loss rule counts them,
    shifted for a causal LM, left as a tensor beside them (read from the device once per window)."""
    settled = trainer._loss_rule.items_on_device(inputs)
    if settled is not None:
        return settled
    label_name = trainer.label_names[0] if trainer.label_names else "labels"
    labels = inputs.get(label_name)
    if isinstance(labels, (list, tuple)):
        # A list of targets per row (detection): counted by the settled rule; until then, one item per row.
        return len(labels)
    if labels is None and inputs.get("shift_labels") is None:
        warn_once(
            trainer,
            "no_labels",
            "GradAccumTrainer: micro-batches carry no `%s`, so each is weighted by its number of rows. That is "
            "exact when the loss is a mean over rows (TRL's DPOTrainer and RewardTrainer: a mean over pairs) and "
            "wrong otherwise: override `count_micro_batch_items` to return what your loss divides by.",
            label_name,
        )
    # Only token-level labels (one per position) can be shifted; a causal-LM check is pointless for the others.
    token_level = labels is not None and (labels if torch.is_tensor(labels) else torch.as_tensor(labels)).dim() > 1
    shift = trainer._shifts_labels() if token_level else False
    return items_on_device(inputs, shift_labels=shift, label_name=label_name)


def shifts_labels(trainer: Any) -> bool:
    """Whether items are counted as a causal LM's loss sees them (`labels[..., 1:]`), decided once per model."""
    override = gradaccum_option(trainer.args, "count_shifted_labels")
    if override is not None:
        return override
    model = trainer.model
    cached = getattr(trainer, "_shift_decision", None)
    if cached is not None and cached[0] is model:
        return cached[1]
    # Sees through PEFT, torch.compile and DDP wrappers, and recognises causal LMs by their loss function or
    # registered class, not only by a "ForCausalLM" class name (GPT2LMHeadModel has none).
    shifts = loss_shifts_labels(model)
    if shifts is None:
        shifts = bool(getattr(trainer, "_loss_shifts_labels", False))
        warn_once(
            trainer,
            "unknown_shift",
            "GradAccumTrainer cannot tell whether %s's loss shifts its token labels (a causal LM never predicts "
            "position 0, so its mean divides by one item fewer per row). Counting them %s; if that is wrong the "
            "update is off (by about one item per row). Set `count_shifted_labels=True/False` in the arguments.",
            type(model).__name__,
            "shifted (labels[..., 1:])" if shifts else "unshifted",
        )
    trainer._shift_decision = (model, shifts)
    return shifts


def warn_once(trainer: Any, key: str, message: str, *args: Any) -> None:
    """Log `message` as a warning the first time `trainer` meets `key`."""
    warned = trainer.__dict__.setdefault("_gradaccum_warned", set())
    if key not in warned:
        warned.add(key)
        logger.warning(message, *args)


def count_prefetched_window(trainer: Any, batch_samples: list[dict[str, Any]]) -> list[int | float] | None:
    """The items of each prefetched micro-batch where the loss sees that very batch (elsewhere they are counted at the
    loss), kept on `trainer` for the micro-steps; `None` where they are not counted here."""
    trainer._window_items_local = None
    trainer._window_counts = {}
    if not (trainer._count_at_prefetch or trainer._handed_count):
        return None
    try:
        counts = trainer._count_window(batch_samples)
    except (ValueError, TypeError, AttributeError):
        return None
    trainer._window_items_local = float(sum(counts))
    # Reused at each micro-step: counting again there would read the device once per micro-batch.
    trainer._window_counts = {id(b): (b, n) for b, n in zip(batch_samples, counts, strict=True)}
    return counts
