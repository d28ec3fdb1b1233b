"""The route each sentence-transformers loss takes under accumulation (coupled, item mean, refused, checked), decided
from its class and settings, and `register_sentence_transformers_loss` to declare one."""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import nn

from .loss_classes import (
    CACHED_COUPLED_LOSSES,
    CACHED_LOSSES,
    CROSS_ENCODER_ROW_LOSSES,
    EMBEDDING_LOSSES,
    GUIDED_LOSSES,
    MULTI_VECTOR_LOSSES,
    REPLAYED_LOSSES,
    ROW_MEAN_EMBEDDING_LOSSES,
    SENTENCE_TRANSFORMERS_TRAINERS,
)

logger = logging.getLogger(__name__)

ROUTES = ("coupled", "item_mean", "refused", "checked")

_REGISTERED: dict[type, str] = {}
LOSS_METHODS = ("forward", "compute_loss_from_embeddings")
"""What makes a loss class the loss it is: a subclass overriding either is not covered by its parent's registration."""


class SentenceTransformersLossError(ValueError):
    """A sentence-transformers loss that `GradAccumTrainer` cannot accumulate exactly, or could not show exact."""


# ---------------------------------------------------------------------------------------------------- detection
def is_sentence_transformers_trainer(trainer: Any) -> bool:
    """Whether `trainer` is one of sentence-transformers' trainers (`SentenceTransformerTrainer`,
    `CrossEncoderTrainer`, `SparseEncoderTrainer`, `MultiVectorEncoderTrainer`), without importing the package."""
    if sys.modules.get("sentence_transformers") is None:
        return False
    return any(
        cls.__name__ in SENTENCE_TRANSFORMERS_TRAINERS and cls.__module__.startswith("sentence_transformers")
        for cls in type(trainer).__mro__
    )


def register_sentence_transformers_loss(loss_cls: type, route: str) -> None:
    """
    Declare how a sentence-transformers loss class accumulates under `GradAccumTrainer`, instead of the first-window
    check that an unknown loss gets:

    - `"coupled"`: the loss has `compute_loss_from_embeddings(embeddings, labels)` and its `forward` is exactly
      "embed every column with `self.model`, then that method": gradient caching over the window (exact);
    - `"item_mean"`: the loss is a mean over independent rows (no sample's loss depends on another sample):
      plain accumulation weighted by rows (exact).

    The declaration covers subclasses that keep its `forward` and `compute_loss_from_embeddings`; a subclass that
    overrides either is routed on its own (declare it too if its new method keeps the contract).

    Example:

    ```python
    >>> from torch import nn
    >>> from hf_gradaccum.integrations.sentence_transformers.routing import register_sentence_transformers_loss
    >>> class MyRowLoss(nn.Module):  # a mean over rows
    ...     pass
    >>> register_sentence_transformers_loss(MyRowLoss, "item_mean")
    ```
    """
    if not isinstance(loss_cls, type):
        raise TypeError(f"`loss_cls` must be a class, got {loss_cls!r}.")
    if route not in ("coupled", "item_mean"):
        raise ValueError(f"`route` must be 'coupled' or 'item_mean', got {route!r}.")
    if route == "coupled" and not callable(getattr(loss_cls, "compute_loss_from_embeddings", None)):
        raise ValueError(f"{loss_cls.__name__} has no `compute_loss_from_embeddings`, which the coupled route calls.")
    _REGISTERED[loss_cls] = route


def _defining_class(loss_cls: type, name: str) -> type | None:
    for cls in loss_cls.__mro__:
        if name in vars(cls):
            return cls
    return None


def sentence_transformers_route(loss: Any) -> tuple[str, str]:
    """
    How `loss` (one sentence-transformers loss module) accumulates exactly: `(route, reason)` with `route` one of
    `"coupled"`, `"item_mean"`, `"refused"`, `"checked"` (see the module docstring).

    Example:

    ```python
    >>> from sentence_transformers import SentenceTransformer, losses  # doctest: +SKIP
    >>> sentence_transformers_route(losses.MultipleNegativesRankingLoss(model))[0]  # doctest: +SKIP
    'coupled'
    ```
    """
    loss_cls = type(loss)
    for cls in loss_cls.__mro__:
        if cls in _REGISTERED:
            # A subclass that defines its own loss below the registered class is another loss (the coupled route
            # would replay the registered `compute_loss_from_embeddings` and never call that `forward`): it is
            # routed as any loss, by the class that defines its `forward`.
            if all(_defining_class(loss_cls, name) is _defining_class(cls, name) for name in LOSS_METHODS):
                return _REGISTERED[cls], f"{cls.__name__} registered as {_REGISTERED[cls]!r}"
            break
    forward_owner = _defining_class(loss_cls, "forward")
    owner = forward_owner.__name__ if forward_owner is not None else ""
    if loss_cls.__name__ in CACHED_LOSSES or owner in CACHED_LOSSES:
        if _cached_math(loss) is not None:
            return "coupled", f"{owner}.calculate_loss on the window's embeddings (the window is its cache)"
        return "refused", "it caches gradients within one micro-batch, so its negatives are the micro-batch's only"
    if owner in GUIDED_LOSSES:
        return "coupled", f"{owner}'s forward replayed on the window's model and guide embeddings"
    if owner in REPLAYED_LOSSES:
        return "coupled", f"{owner}'s forward replayed on the window's embeddings"
    if owner in MULTI_VECTOR_LOSSES:
        return "coupled", f"{owner}'s forward replayed on the window's token embeddings"
    if owner in CROSS_ENCODER_ROW_LOSSES and _is_cross_encoder_loss(forward_owner):
        return "item_mean", f"{owner} is a mean over independent query-document pairs"
    # Its `forward` is the known class's, and so is `compute_loss_from_embeddings` (older releases have none).
    loss_method = _defining_class(loss_cls, "compute_loss_from_embeddings")
    if owner in ROW_MEAN_EMBEDDING_LOSSES and loss_method in (forward_owner, None):
        settings = row_mean_settings(loss)
        if settings is not None:
            return "item_mean", f"{owner} is a mean over independent rows ({settings})"
    if owner in EMBEDDING_LOSSES and callable(getattr(loss, "compute_loss_from_embeddings", None)):
        return "coupled", f"{owner}.compute_loss_from_embeddings on the window's embeddings"
    if replays_own_forward(loss):
        parent = _library_loss_parent(loss_cls)
        return "coupled", (
            f"its own forward ({owner}.forward, a subclass of {parent.__name__}) replayed on the window's embeddings, "
            "checked against the model on the first window"
        )
    return "checked", "not a loss GradAccumTrainer knows how to accumulate"


def _library_loss_parent(loss_cls: type) -> type | None:
    """The nearest sentence-transformers embedding loss class `loss_cls` derives from, if any."""
    for cls in loss_cls.__mro__:
        if cls.__module__.startswith("sentence_transformers") and cls.__name__ in (
            *EMBEDDING_LOSSES,
            *REPLAYED_LOSSES,
        ):
            return cls
    return None


def replays_own_forward(loss: Any) -> bool:
    """
    Whether `loss` is accumulated by running its own `forward` against a stand-in for the model that hands it the
    window's embeddings: a subclass of one of sentence-transformers' embedding losses (`MultipleNegativesRankingLoss`,
    `CoSENTLoss`, `SpladeLoss`, ...) that overrides `forward`, so that its own code runs as written. Its first window
    checks the replay against the loss on the model; a forward the replay cannot serve (calling the model on inputs
    of its own, more than once per column, or reading other outputs) falls back to the split-invariance check.

    Example:

    ```python
    >>> from sentence_transformers import losses  # doctest: +SKIP
    >>> class Logged(losses.MultipleNegativesRankingLoss):  # doctest: +SKIP
    ...     def forward(self, features, labels):
    ...         return super().forward(features, labels)
    >>> replays_own_forward(Logged(model))  # doctest: +SKIP
    True
    ```
    """
    loss_cls = type(loss)
    parent = _library_loss_parent(loss_cls)
    if parent is None or _defining_class(loss_cls, "forward") is parent:
        return False
    if getattr(loss, "uses_gradient_cache", False):
        return False
    return isinstance(getattr(loss, "model", None), nn.Module)


def _cached_math(loss: Any) -> str | None:
    """For a cached loss routed to the coupled mode: `"columns"` (its `calculate_loss(reps, labels)` takes each
    column's sentence embeddings) or `"tokens"` (the multi-vector one's takes token embeddings and scoring masks);
    `None` for one that stays refused (a subclass that redefines how it embeds or what it computes, CrossEncoder's)."""
    loss_cls = type(loss)
    owners = {name: _defining_class(loss_cls, name) for name in ("forward", "calculate_loss", "embed_minibatch")}
    if any(owner is None for owner in owners.values()) or _is_cross_encoder_loss(owners["forward"]):
        return None
    if not all(
        owner.__name__ in (*CACHED_COUPLED_LOSSES, "CachedLossMixin")
        and owner.__module__.startswith("sentence_transformers")
        for owner in owners.values()
    ):
        return None
    return "tokens" if owners["forward"].__name__ == "CachedMultiVectorMultipleNegativesRankingLoss" else "columns"


def row_mean_settings(loss: nn.Module) -> str | None:
    """
    Whether a `CosineSimilarityLoss`, `ContrastiveLoss`, `TripletLoss`, `MarginMSELoss` or `DistillKLDivLoss` is, with
    the settings it was built with, a mean over independent rows: its score or distance function compares each row's
    own embeddings only, and it averages over rows. Returns the settings that make it so, or `None` for anything
    not recognised (a custom `loss_fct`, a sum instead of a mean, a similarity function of your own), which keeps the
    coupled route: exact too, at one more forward per micro-batch.

    Example:

    ```python
    >>> from sentence_transformers import losses  # doctest: +SKIP
    >>> row_mean_settings(losses.ContrastiveLoss(model))  # doctest: +SKIP
    'size_average=True, a per-row distance'
    ```
    """
    from sentence_transformers import util

    per_row = {
        util.pairwise_dot_score,
        util.pairwise_cos_sim,
        util.pairwise_euclidean_sim,
        util.pairwise_manhattan_sim,
        util.pairwise_angle_sim,
    }
    name = type(loss).__name__
    if name == "CosineSimilarityLoss":
        fct, transform = getattr(loss, "loss_fct", None), getattr(loss, "cos_score_transformation", None)
        elementwise = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)
        if type(fct) in elementwise and fct.reduction == "mean" and type(transform) is nn.Identity:
            return f"loss_fct={type(fct).__name__}(reduction='mean') over one score per row"
        return None
    metrics = _metric_functions(loss)
    if name == "ContrastiveLoss":
        if getattr(loss, "size_average", None) is True and getattr(loss, "distance_metric", None) in metrics:
            return "size_average=True, a per-row distance"
        return None
    if name == "TripletLoss":
        return "a per-row distance, mean over triplets" if getattr(loss, "distance_metric", None) in metrics else None
    if name in ("MarginMSELoss", "DistillKLDivLoss"):
        fct = getattr(loss, "loss_fct", None)
        reductions = {"MarginMSELoss": (nn.MSELoss, "mean"), "DistillKLDivLoss": (nn.KLDivLoss, "batchmean")}[name]
        if (
            getattr(loss, "similarity_fct", None) in per_row
            and type(fct) is reductions[0]
            and fct.reduction == reductions[1]
        ):
            return f"a per-row similarity, {type(fct).__name__}(reduction={reductions[1]!r})"
        return None
    return None


def _metric_functions(loss: nn.Module) -> list[Any]:
    """The distance functions of the loss's module-level metric class (`TripletDistanceMetric`,
    `SiameseDistanceMetric`): each compares one row's embeddings only."""
    module = sys.modules.get(type(loss).__module__)
    functions: list[Any] = []
    for class_name in ("TripletDistanceMetric", "SiameseDistanceMetric"):
        holder = getattr(module, class_name, None)
        if holder is not None:
            functions += [value for key, value in vars(holder).items() if key.isupper() and callable(value)]
    return functions


def _is_cross_encoder_loss(cls: type | None) -> bool:
    # Loss names repeat across the encoders (MarginMSELoss is an embedding loss for SentenceTransformer).
    return cls is not None and cls.__module__.startswith("sentence_transformers.cross_encoder")


# ---------------------------------------------------------------------------------------------------- coupled losses
# Keys the trainers' `compute_loss` pops before `collect_features` (CrossEncoder's takes every other key as a column).
