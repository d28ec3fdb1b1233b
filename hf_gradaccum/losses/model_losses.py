"""What a model's own loss divides by, and what to do when nothing does: the rules `GradAccumTrainer` and the plain
loop follow before their first optimizer step.

A micro-batch is weighted by what its loss is normalised by, and models fix that in their own `forward`. On the first
window, before any step:

- **BatchNorm in training mode** normalises each micro-batch by its own statistics: no weighting makes that the large
  batch, so training stops, naming the options (GroupNorm conversion, frozen statistics, or
  `batchnorm_statistics="micro_batch"` to keep per-micro-batch statistics knowingly).
- **In-model contrastive losses** (`CLIPModel`, `SiglipModel` and the like with `return_loss=True`) couple every pair
  of the batch: the coupled mode (gradient caching over the window) is chosen for the models it knows, and any other
  stops, saying how to declare one.
- **Several terms with their own counts** (`BertForPreTraining`: masked-LM tokens plus next-sentence rows) are exact
  with a weight per term, each divided by its own count over the window ([`WindowTerms`]).
- **Everything else is measured** ([`~hf_gradaccum.engine.loss_normalisation.measure_loss_normalisation`]): a mean
  over some count is weighted by that count, a sum is summed, and a loss that is neither stops with the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.items import IGNORE_INDEX
from ..engine.window_losses.coupled import CoupledLoss
from .coupled import clip_window_loss
from .model_inspection import unwrap_model


class ModelLossError(ValueError):
    """A model whose loss no weighting of micro-batches makes the large batch's: raised before the first optimizer
    step (weights, optimizer state and checkpoints untouched), with the cause and the fix."""


def training_batchnorms(model: nn.Module) -> list[str]:
    """The BatchNorm layers of `model` (seen through wrappers) that normalise by the batch's statistics now: every
    `_BatchNorm` in training mode (a frozen or eval-mode one normalises each row by stored statistics)."""
    return [name for name, m in unwrap_model(model).named_modules() if isinstance(m, _BatchNorm) and m.training]


def refuse_batchnorm(model: nn.Module) -> ModelLossError:
    """The error for a model with BatchNorm layers in training mode, naming the three ways out."""
    names = training_batchnorms(model)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ModelLossError(
        f"{type(unwrap_model(model)).__name__} has {len(names)} BatchNorm layer(s) in training mode ({shown}): each "
        "normalises a micro-batch by that micro-batch's own statistics, so no accumulation equals the large batch. "
        "Stopped before the first optimizer step.\nFix (one of): `model = convert_batchnorm_to_groupnorm(model)` "
        "(exact; docs/design.md), `model = freeze_batchnorm(model)` (stored statistics, exact), or "
        '`batchnorm_statistics="micro_batch"` in the arguments to train with per-micro-batch statistics knowingly.'
    )


# ---------------------------------------------------------------------------------------------------- contrastive
def _embeddings(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    inputs = {k: v for k, v in batch.items() if k not in ("return_loss", "labels")}
    out = model(**inputs, return_loss=False)
    return {"text": out.text_embeds, "image": out.image_embeds}


def siglip_window_loss(
    text_embeds: torch.Tensor, image_embeds: torch.Tensor, logit_scale: torch.Tensor, logit_bias: torch.Tensor
) -> torch.Tensor:
    """`SiglipModel(..., return_loss=True).loss` from normalised embeddings: the pairwise sigmoid loss over every
    (text, image) pair of the batch, summed per text and averaged over texts."""
    logits = text_embeds @ image_embeds.t() * logit_scale.exp() + logit_bias
    signs = 2 * torch.eye(len(logits), device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(signs * logits).sum(dim=-1).mean()


def _clip_loss(reps: Mapping[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    return clip_window_loss(reps["text"], reps["image"], unwrap_model(model).logit_scale)


def _siglip_loss(reps: Mapping[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    base = unwrap_model(model)
    return siglip_window_loss(reps["text"], reps["image"], base.logit_scale, base.logit_bias)


# Model class -> the window loss of its `return_loss=True` forward, from the embeddings it returns.
# Each is checked against the model's own `return_loss=True` loss on the first micro-batch before it trains
# (`check_contrastive_loss`).
IN_MODEL_CONTRASTIVE_LOSSES: dict[str, Callable[[Mapping[str, torch.Tensor], nn.Module], torch.Tensor]] = {
    "CLIPModel": _clip_loss,
    "ChineseCLIPModel": _clip_loss,
    "AltCLIPModel": _clip_loss,
    "BlipModel": _clip_loss,
    "OwlViTModel": _clip_loss,
    "SiglipModel": _siglip_loss,
}


def in_model_contrastive(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether `batch` asks `model` for an in-batch contrastive loss of its own (`return_loss=True`)."""
    return bool(batch.get("return_loss")) and "return_loss" in _forward_parameters(model)


def _forward_parameters(model: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(unwrap_model(model).forward).parameters)
    except (TypeError, ValueError):
        return set()


def contrastive_coupled_loss(model: nn.Module) -> CoupledLoss:
    """The coupled loss equal to `model`'s own `return_loss=True` loss over the window, or a `ModelLossError` for a
    model whose in-batch loss is not known here."""
    name = type(unwrap_model(model)).__name__
    loss = IN_MODEL_CONTRASTIVE_LOSSES.get(name)
    if loss is None:
        raise ModelLossError(
            f"{name} computes an in-batch contrastive loss (`return_loss=True`): every row's loss depends on the "
            "other rows of its batch, so no weighting of micro-batches equals the large batch. Stopped before the "
            f"first optimizer step.\nFix: `GradAccumTrainer(..., coupled_loss=CoupledLoss(embed_fn, loss_fn))` with "
            f"{name}'s loss over the window's embeddings (docs/coupled_losses.md); known: "
            f"{sorted(IN_MODEL_CONTRASTIVE_LOSSES)}."
        )
    return CoupledLoss(_embeddings, loss)


def check_contrastive_loss(coupled: CoupledLoss, model: nn.Module, batch: Mapping[str, Any], tolerance: float) -> None:
    """Raise a `ModelLossError` unless the window loss computed from `model`'s embeddings of `batch` is the model's
    own `return_loss=True` loss on it (the registry entry describes this model's loss)."""
    with torch.no_grad():
        own = float(model(**batch).loss)
        mine = float(coupled.loss_fn(coupled.embed_fn(model, batch), model))
    if abs(own - mine) > tolerance * max(abs(own), 1e-12):
        name = type(unwrap_model(model)).__name__
        raise ModelLossError(
            f"{name} computes an in-batch contrastive loss (`return_loss=True`), and the window loss registered for "
            f"it does not reproduce it ({mine:.6g} from its embeddings, {own:.6g} from the model). Stopped before the "
            "first optimizer step.\nFix: `GradAccumTrainer(..., coupled_loss=CoupledLoss(embed_fn, loss_fn))` with "
            f"{name}'s loss over the window's embeddings (docs/coupled_losses.md)."
        )


# ---------------------------------------------------------------------------------------------------- several terms
@dataclass(frozen=True)
class CrossEntropyTerm:
    """One term of a model's loss: the cross-entropy of output `logits` against input `labels`, a mean over the
    labels that are not -100."""

    logits: str
    labels: str

    def items(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return batch[self.labels].ne(IGNORE_INDEX).sum()

    def summed(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        logits = outputs[self.logits]
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch[self.labels].reshape(-1), reduction="sum"
        )


_MLM = CrossEntropyTerm("prediction_logits", "labels")
# Pre-training heads whose loss is a masked-LM mean over tokens plus a sentence-level mean over rows.
MODEL_LOSS_TERMS: dict[str, tuple[CrossEntropyTerm, ...]] = {
    "BertForPreTraining": (_MLM, CrossEntropyTerm("seq_relationship_logits", "next_sentence_label")),
    "ErnieForPreTraining": (_MLM, CrossEntropyTerm("seq_relationship_logits", "next_sentence_label")),
    "MegatronBertForPreTraining": (_MLM, CrossEntropyTerm("seq_relationship_logits", "next_sentence_label")),
    "MobileBertForPreTraining": (_MLM, CrossEntropyTerm("seq_relationship_logits", "next_sentence_label")),
    "FNetForPreTraining": (_MLM, CrossEntropyTerm("seq_relationship_logits", "next_sentence_label")),
    "AlbertForPreTraining": (_MLM, CrossEntropyTerm("sop_logits", "sentence_order_label")),
}


def model_loss_terms(model: nn.Module, batch: Mapping[str, Any]) -> tuple[CrossEntropyTerm, ...] | None:
    """The registered terms of `model`'s loss, where `batch` carries every term's labels."""
    terms = MODEL_LOSS_TERMS.get(type(unwrap_model(model)).__name__)
    if terms is None or any(batch.get(t.labels) is None for t in terms):
        return None
    return terms


class DetectionTerms:
    """
    The loss of transformers' DETR-style detection heads (`loss_type="ForObjectDetection"`: DETR, YOLOS, Table
    Transformer), made exact per term. Its class term is a cross-entropy over every query, weighted 1 for a query
    matched to a box and `eos_coefficient` for the others, so it divides by `boxes + eos * (queries - boxes)`; its box
    terms (L1, GIoU) divide by the batch's boxes. Each term of the model's `loss_dict` is turned back into its sum and
    divided by its count over the window.

    Example:

    ```python
    >>> terms = DetectionTerms(model.config)  # doctest: +SKIP
    >>> terms.prepare(window_batches)  # doctest: +SKIP
    ```
    """

    def __init__(self, config: Any) -> None:
        self.eos = float(config.eos_coefficient)
        self.queries = int(getattr(config, "num_queries", None) or config.num_detection_tokens)
        weights = {"loss_ce": 1.0, "loss_bbox": float(config.bbox_loss_coefficient),
                   "loss_giou": float(config.giou_loss_coefficient)}  # fmt: skip
        if getattr(config, "auxiliary_loss", False):
            for i in range(config.decoder_layers - 1):
                weights.update({f"{k}_{i}": v for k, v in list(weights.items()) if k.count("_") == 1})
        self.weights = weights
        self.counts = {"ce": 0.0, "boxes": 0.0}

    def _local(self, batch: Mapping[str, Any]) -> dict[str, float]:
        targets = batch["labels"]
        boxes = float(sum(len(t["class_labels"]) for t in targets))
        return {"ce": boxes + self.eos * (len(targets) * self.queries - boxes), "boxes": boxes}

    @staticmethod
    def _kind(key: str) -> str:
        return "ce" if key.startswith("loss_ce") else "boxes"

    def prepare(self, batches: Sequence[Mapping[str, Any]]) -> None:
        """The window's weighted query count and box count."""
        local = [self._local(b) for b in batches]
        self.counts = {kind: sum(c[kind] for c in local) for kind in ("ce", "boxes")}

    def micro_batch_loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        local = self._local(batch)
        divisors = {"ce": local["ce"], "boxes": max(local["boxes"], 1.0)}  # the model clamps its box count at 1
        parts = []
        for key, weight in self.weights.items():
            value = outputs["loss_dict"].get(key)
            total = max(self.counts[self._kind(key)], 1.0 if self._kind(key) == "boxes" else 0.0)
            if value is not None and total > 0:
                parts.append(weight * value * (divisors[self._kind(key)] / total))
        return torch.stack(parts).sum()

    def check_against(self, loss: torch.Tensor, outputs: Any, batch: Mapping[str, Any], tolerance: float) -> str:
        """Empty if the weighted `loss_dict` terms add up to the model's own `loss`."""
        loss_dict = outputs.get("loss_dict") if hasattr(outputs, "get") else None
        if not loss_dict:
            return "no loss_dict in the outputs"
        total = sum(float(loss_dict[k]) * w for k, w in self.weights.items() if k in loss_dict)
        if abs(total - float(loss)) <= tolerance * max(abs(float(loss)), 1e-12):
            return ""
        return f"the weighted terms add up to {total:.6g}, the model's loss is {float(loss):.6g}"


# transformers' losses known to be one mean, by `loss_type`: the rule is kept where it holds and rules that weigh the
# window otherwise hold too (the focal-loss DETR detectors divide every term by the batch's boxes; at initialisation
# their parts' losses can be too alike for the cuts to tell boxes from rows).
REGISTERED_RULES: dict[str, str] = {
    "DeformableDetrForObjectDetection": "boxes",
    "ConditionalDetrForObjectDetection": "boxes",
    "DabDetrForObjectDetection": "boxes",
}


def registered_rule(model: nn.Module) -> str | None:
    """The single weighting registered for `model`'s loss ([`REGISTERED_RULES`]), if any."""
    return REGISTERED_RULES.get(getattr(unwrap_model(model), "loss_type", None) or "")


def registered_terms(model: nn.Module, batch: Mapping[str, Any]) -> WindowTerms | DetectionTerms | None:
    """The per-term weighting registered for `model`'s loss, where `batch` carries what it needs."""
    base = unwrap_model(model)
    terms = model_loss_terms(base, batch)
    if terms is not None:
        return WindowTerms(terms)
    if getattr(base, "loss_type", None) == "ForObjectDetection" or (
        type(base).__name__
        in ("DetrForObjectDetection", "YolosForObjectDetection", "TableTransformerForObjectDetection")
    ):
        labels = batch.get("labels")
        if isinstance(labels, (list, tuple)) and labels and all(isinstance(t, Mapping) for t in labels):
            return DetectionTerms(base.config)
    return None


class WindowTerms:
    """
    A loss of several terms, each a mean over its own count, made exact: each micro-batch's loss becomes
    `sum_t sum_k(term t) / C_t`, with `C_t` the window's count of term t over every rank, so the window's losses sum
    to the large batch's (the accumulator then sums instead of averaging: `sums_losses`).

    Example:

    ```python
    >>> terms = WindowTerms(MODEL_LOSS_TERMS["BertForPreTraining"])
    >>> terms.prepare(window_batches)  # doctest: +SKIP
    >>> loss = terms.micro_batch_loss(outputs, batch)  # doctest: +SKIP
    ```
    """

    def __init__(self, terms: Sequence[CrossEntropyTerm]) -> None:
        self.terms = tuple(terms)
        self.counts: list[float] = [0.0] * len(self.terms)

    def prepare(self, batches: Sequence[Mapping[str, Any]]) -> None:
        """The window's count of each term over every rank (one all-reduce)."""
        if not batches:
            return
        local = torch.stack([sum(t.items(b) for b in batches) for t in self.terms]).double()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        self.counts = [float(c) for c in local.tolist()]

    def micro_batch_loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """This micro-batch's share of the window's loss."""
        parts = [t.summed(outputs, batch) / c for t, c in zip(self.terms, self.counts, strict=True) if c > 0]
        return torch.stack(parts).sum() if parts else outputs["loss"] * 0.0

    def check_against(self, loss: torch.Tensor, outputs: Any, batch: Mapping[str, Any], tolerance: float) -> str:
        """Empty if the terms, each divided by its count in `batch` alone, add up to the model's own `loss` on it;
        otherwise what differs (the registry entry does not describe this model's loss)."""
        parts = []
        for term in self.terms:
            items = float(term.items(batch))
            if items > 0:
                parts.append(float(term.summed(outputs, batch)) / items)
        own = float(loss)
        if abs(sum(parts) - own) <= tolerance * max(abs(own), 1e-12):
            return ""
        return f"the terms add up to {sum(parts):.6g}, the model's loss is {own:.6g}"
