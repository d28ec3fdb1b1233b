"""The stops of the loss measurement, in words a user can act on: the class whose code computes the loss (the
user's subclass where it overrides `compute_loss`), what was measured, and a fix that works. A rule the window
contradicted is never suggested."""

from __future__ import annotations

import math
from typing import Any

from ..engine.loss_normalisation import NormalisationFinding
from .model_inspection import unwrap_model
from .trainer_probe import loss_class

COUNT_EXAMPLE = """    # a method of {name}:
        def count_micro_batch_items(self, inputs):
            return inputs["sample_weight"].sum()  # sample weights: the divisor of sum(w * loss) / sum(w)
            # class weights w of CrossEntropyLoss(weight=w):
            # labels = inputs["labels"]; return w.to(labels.device)[labels[labels != -100]].sum()"""

TERMS_EXAMPLE = """    # methods of {name}:
        def count_micro_batch_items(self, inputs):
            return {{"tokens": inputs["labels"].ne(-100).sum(), "rows": len(inputs["labels"])}}
        # and in compute_loss, each term's mean by the same name:
        #     return mean_terms(self, inputs, tokens=token_loss, rows=row_loss)"""


def loss_owner(trainer: Any) -> str:
    """The class whose code computes the loss: the user's `compute_loss` subclass, else the model."""
    cls = loss_class(trainer)
    if cls is not None:
        return f"{cls.__name__}.compute_loss"
    return type(unwrap_model(trainer.model)).__name__


def _residuals(finding: NormalisationFinding) -> str:
    shown = sorted(finding.residuals.items(), key=lambda kv: kv[1])[:5]
    text = ", ".join(f"{rule} {value:.2g}" if math.isfinite(value) else f"{rule} n/a" for rule, value in shown)
    return f"loss residuals per rule: {text}" if text else "nothing measured"


def normalisation_stop(trainer: Any, finding: NormalisationFinding, *, window: str = "the first window") -> str:
    """The message of a stop on `finding` (its `stop`, or no weighting at all)."""
    owner = loss_owner(trainer)
    cause = finding.stop or finding.note
    headline = (
        "its loss is not a mean over any count its batch carries, nor a sum, on the evidence of"
        if finding.rule == "none" and not finding.stop.startswith("window")
        else "what its loss divides by could not be settled on"
    )
    base = type(trainer).__name__
    holding = [r for r in finding.consistent if r in ("label_tokens", "shifted_label_tokens", "rows", "sum", "boxes")]
    lines = [
        f"{owner}: {headline} {window} ({cause}; {_residuals(finding)}). "
        "Stopped before the optimizer step: no weighting of micro-batches that the window supports gives the large "
        "batch's update, and a guess could train silently wrong.",
        "Fix, depending on your loss:",
        "- a weighted mean (sample weights, class weights): return its divisor from `count_micro_batch_items`, e.g.\n"
        + COUNT_EXAMPLE.format(name=base),
        "- terms with different counts (two heads: a token mean plus a row mean): declare each term's count and "
        "combine the terms with `hf_gradaccum.mean_terms`, e.g.\n" + TERMS_EXAMPLE.format(name=base),
        "- a statistic of the whole batch (in-batch negatives, a batch-level penalty): a `coupled_loss=` "
        "(docs/coupled_losses.md), or `gradient_accumulation_steps=1` with the batch you want.",
    ]
    if holding:
        lines.append(f"- the window supports: {', '.join(holding)} (`loss_normalisation=`), if you know it is right.")
    return "\n".join(lines)


def declared_stop(trainer: Any, finding: NormalisationFinding, what: str) -> str:
    """The message of a declaration (`what`) the window contradicts."""
    return (
        f"{loss_owner(trainer)}: {what} is contradicted by the first window ({finding.stop}; {_residuals(finding)}). "
        "Stopped before the first optimizer step.\nFix: return what the loss really divides by (the sum of the "
        "weights of a weighted mean, each term's own count), or, if you are sure the probe cannot run your loss as "
        "training does, `check_declared_normalisation=False`."
    )


def cut_failed_stop(trainer: Any, failed: BaseException) -> str:
    """The message where the loss runs on a micro-batch but not on some of its rows alone."""
    return (
        f"{loss_owner(trainer)}: what its loss divides by could not be measured, because it runs on a whole "
        f"micro-batch but fails on some of its rows alone ({failed}); rows of its batch may refer to one another "
        "(indices into the whole batch), which no weighting of micro-batches can follow. Stopped before the first "
        "optimizer step.\nFix: make the loss of a subset of rows computable (per-row indices), or "
        "`gradient_accumulation_steps=1` with the batch you want."
    )
