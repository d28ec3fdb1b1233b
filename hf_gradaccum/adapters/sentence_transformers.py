"""sentence-transformers' trainers composed with [`GradAccumTrainer`]: exact without configuration.

Every trainer sentence-transformers ships (`SentenceTransformerTrainer`, `CrossEncoderTrainer`,
`SparseEncoderTrainer`, `MultiVectorEncoderTrainer`; in 6.x all subclasses of its `BaseTrainer`) is routed here.

Many sentence-transformers losses couple the batch: with in-batch negatives (`MultipleNegativesRankingLoss`, its
symmetric variant, `GISTEmbedLoss`) every sample is a negative for every other, and CoSENT/AnglE or the batch-hard
triplet losses compare all pairs of the batch. Accumulating each micro-batch's own loss trains a weaker objective than
the large batch, whatever the weighting. Composing `GradAccumTrainer` with `SentenceTransformerTrainer` (either class
order) therefore routes the loss, on the first training window, to one of:

- **coupled** (gradient caching, `engine/coupled.py`): for a loss that computes its value from the column
  embeddings (its `compute_loss_from_embeddings`, fed the whole window's embeddings and labels, so its own
  similarity function, scale, directions and hardness settings apply), for `GISTEmbedLoss` (its own `forward`
  replayed on the window's model and guide embeddings) and for SparseEncoder's `SpladeLoss` (its own `forward`
  replayed on the window's embeddings: the ranking loss and the FLOPS regularisers, which are batch means, see the
  whole window), for a subclass of those losses that overrides `forward` (its own `forward` run on the window
  against a stand-in for the model that hands it the window's embeddings, compared with the loss on the model on the
  first micro-batch before the first step; a forward the stand-in cannot serve falls back to **checked**), and for
  the cached losses with a `calculate_loss` of their embeddings (`CachedMultipleNegativesRankingLoss`, its symmetric
  variant, `CachedSpladeLoss`, `CachedMultiVectorMultipleNegativesRankingLoss`: the coupled mode is gradient caching
  over the window, so their cache is the window). Micro-batches are weighted by rows. Exact.
- **item_mean**: CrossEncoder losses that are a mean over independent pairs (`BinaryCrossEntropyLoss`,
  `CrossEntropyLoss`, `MSELoss`, `MarginMSELoss`), and the embedding losses that are a mean over independent rows
  with the settings they were built with (`CosineSimilarityLoss`, `ContrastiveLoss`, `TripletLoss`,
  `MarginMSELoss`, `DistillKLDivLoss`: [`row_mean_settings`]): plain accumulation weighted by rows. Exact, and
  without the coupled mode's extra forward per micro-batch.
- **refused**: `CachedGISTEmbedLoss` and CrossEncoder's `CachedMultipleNegativesRankingLoss` under accumulation (and a
  cached loss subclass that redefines how it embeds or computes): they cache within one micro-batch only, so their
  negatives are the micro-batch's. The error names the non-cached loss to use instead.
- **checked**: any other loss. Before the first optimizer step the split-invariance check runs on the first window
  (the trainer's own `compute_loss`, rows as items) and training stops with an error naming the trainer, the loss and
  the fix unless it finds the loss exact. [`register_sentence_transformers_loss`] declares a loss class instead.

With `gradient_accumulation_steps=1` nothing is routed: the trainer behaves as the stock composition.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.coupled import CoupledLoss, rows_in
from .compositions import (
    CACHED_COUPLED_LOSSES,
    CACHED_LOSSES,
    CROSS_ENCODER_CACHED_FIX,
    CROSS_ENCODER_ROW_LOSSES,
    EMBEDDING_LOSSES,
    GUIDED_LOSSES,
    MULTI_VECTOR_LOSSES,
    REPLAYED_LOSSES,
    ROW_MEAN_EMBEDDING_LOSSES,
    SENTENCE_TRANSFORMERS_TRAINERS,
)
from .coupled import CoupledWindowMode

__all__ = [
    "SentenceTransformersLossError",
    "is_sentence_transformers_trainer",
    "register_sentence_transformers_loss",
    "route_sentence_transformers",
    "sentence_transformers_coupled_loss",
    "sentence_transformers_route",
]

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
    >>> from hf_gradaccum.adapters.sentence_transformers import register_sentence_transformers_loss
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
NON_FEATURE_KEYS = ("dataset_name", "prompt", "task")


def _features(trainer: Any, batch: Mapping[str, Any]) -> tuple[list[Any], torch.Tensor | None]:
    """The column features and labels of a collated batch, as the trainer's `compute_loss` splits it."""
    features, labels = trainer.collect_features({k: v for k, v in batch.items() if k not in NON_FEATURE_KEYS})
    if not features:
        raise ValueError(f"A sentence-transformers batch with no feature columns: {sorted(batch)}.")
    return features, labels if torch.is_tensor(labels) else None


def _columns_as_losses_embed(model: nn.Module, features: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Each column's embeddings as the installed sentence-transformers' losses compute them: 6.x merges columns that
    preprocess alike into one forward (`embed_columns`); 5.x runs one forward per column."""
    try:
        from sentence_transformers.base.losses.merged_forward import embed_columns as merged
    except ImportError:  # sentence-transformers 5.x
        return [model(column)["sentence_embedding"] for column in features]
    return merged(model, features)


def _embed_columns_separate_first(
    model: nn.Module, features: list[dict[str, Any]], separate_first: bool
) -> list[torch.Tensor]:
    """Each column's embeddings as sentence-transformers' `embed_columns(model, features, separate_first)` computes
    them (a loss that calls it with `separate_first=False` merges the first column into the others' forward)."""
    from sentence_transformers.base.losses.merged_forward import embed_columns

    return embed_columns(model, features, separate_first=separate_first)


def _embed_columns(model: nn.Module, features: list[dict[str, Any]], first_only: bool) -> list[torch.Tensor]:
    # The batch-triplet losses embed only the first column (`self.sentence_embedder(sentence_features[0])`).
    if first_only:
        return [model(features[0])["sentence_embedding"]]
    return _columns_as_losses_embed(model, features)


@contextlib.contextmanager
def _attributes(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes of `obj` for the duration of the block (submodules included), then put the old ones back."""
    old = {name: getattr(obj, name) for name in values}
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(obj, name, value)


def _scalar(loss: Any) -> torch.Tensor:
    # A loss returning named components is summed, as `SentenceTransformerTrainer.compute_loss` sums them.
    return torch.stack(list(loss.values())).sum() if isinstance(loss, Mapping) else loss


def _window_world(loss: nn.Module) -> dict[str, Any]:
    """`gather_across_ranks` for the coupled loss, from the loss's own `gather_across_devices`: the window is every
    rank's when the loss gathers (then the loss itself must not gather again), each rank's own otherwise (the stock
    per-rank large batch, whose gradients DDP averages)."""
    gathers = bool(getattr(loss, "gather_across_devices", False))
    return {"gather_across_ranks": gathers}


def _column_embedder(trainer: Any, embed_columns: Any) -> Any:
    """`embed_fn` of the coupled loss: the batch's column embeddings (`embed_columns(model, features)`) and its
    labels, if any."""

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        features, labels = _features(trainer, batch)
        reps: dict[str, Any] = {"embeddings": embed_columns(model, features)}
        if labels is not None:
            reps["labels"] = labels
        return reps

    return embed


def _embedding_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    first_only = _defining_class(type(loss), "forward").__name__.startswith("Batch")
    embed = _column_embedder(trainer, lambda model, features: _embed_columns(model, features, first_only))

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        no_gather = {"gather_across_devices": False} if hasattr(loss, "gather_across_devices") else {}
        with _attributes(loss, **no_gather):
            return _scalar(loss.compute_loss_from_embeddings(list(reps["embeddings"]), reps.get("labels")))

    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **_window_world(loss))


COLUMN_KEY = "gradaccum_column"


class _Replay(nn.Module):
    """Stands in for a model inside a loss's `forward`: returns the window's precomputed embedding of a column."""

    def __init__(self, columns: list[torch.Tensor]) -> None:
        super().__init__()
        self.columns = columns

    def forward(self, features: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"sentence_embedding": self.columns[features[COLUMN_KEY]]}


def _gist_guide_embeddings(loss: nn.Module, features: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The guide's embeddings as `GISTEmbedLoss.forward` computes them (re-tokenised when the guide's tokenizer or
    length differs), without a graph."""
    from sentence_transformers.util import batch_to_device

    with torch.no_grad():
        if getattr(loss, "must_retokenize", False):
            guide_features = []
            for feature in features:
                decoded = loss.tokenizer.batch_decode(feature["input_ids"], skip_special_tokens=True)
                guide_features.append(batch_to_device(loss.guide.preprocess(decoded), loss.guide.device))
        else:
            guide_features = [dict(feature) for feature in features]
        return [e.detach() for e in _columns_as_losses_embed(loss.guide, guide_features)]


def _gist_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        features, labels = _features(trainer, batch)
        guide = _gist_guide_embeddings(loss, features)
        reps: dict[str, Any] = {"embeddings": _embed_columns(model, features, False), "guide": guide}
        if labels is not None:
            reps["labels"] = labels
        return reps

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        columns = [{COLUMN_KEY: i} for i in range(len(reps["embeddings"]))]
        replaced = {"model": _Replay(list(reps["embeddings"])), "guide": _Replay(list(reps["guide"]))}
        replaced["must_retokenize"] = False  # the guide embeddings are already the re-tokenised ones
        if hasattr(loss, "gather_across_devices"):
            replaced["gather_across_devices"] = False
        with _attributes(loss, **replaced):
            return _scalar(loss(columns, reps.get("labels")))

    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **_window_world(loss))


def _replayed_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    # SpladeLoss embeds with `embed_columns(model, features, separate_first=not use_document_regularizer_only)`.
    separate_first = not bool(getattr(loss, "use_document_regularizer_only", False))
    inner = getattr(loss, "loss", None)
    gathering = [m for m in (loss, inner) if isinstance(m, nn.Module) and hasattr(m, "gather_across_devices")]
    embed = _column_embedder(
        trainer, lambda model, features: _embed_columns_separate_first(model, features, separate_first)
    )

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        columns = [{COLUMN_KEY: i} for i in range(len(reps["embeddings"]))]
        with contextlib.ExitStack() as stack:
            # The window's embeddings are already every rank's when the loss gathers: it must not gather again.
            for module in gathering:
                stack.enter_context(_attributes(module, gather_across_devices=False))
            stack.enter_context(_attributes(loss, model=_Replay(list(reps["embeddings"]))))
            return _scalar(loss(columns, reps.get("labels")))

    world = {"gather_across_ranks": any(bool(m.gather_across_devices) for m in gathering)}
    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **world)


class _TokenReplay(nn.Module):
    """Stands in for a multi-vector model inside a loss's `forward`: the window's token embeddings and scoring mask
    of a column."""

    def __init__(self, tokens: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.tokens, self.masks = tokens, masks

    def forward(self, features: Mapping[str, Any], task: str | None = None) -> dict[str, torch.Tensor]:
        column = features[COLUMN_KEY]
        return {"token_embeddings": self.tokens[column], "attention_mask": self.masks[column]}


def _multi_vector_embedder(trainer: Any) -> Any:
    """`embed_fn` of a multi-vector coupled loss: each column's token embeddings and scoring mask. Micro-batches have
    token axes of their own lengths: each is padded to the model's maximum (masked out, so the scores are the large
    batch's) for the window's embeddings to be concatenated."""
    width = int(trainer.model.get_max_seq_length())

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        features, labels = _features(trainer, batch)
        tokens, masks = [], []
        for index, columns in enumerate(features):
            # The task the loss gives each column (the first is the query, the others documents).
            out = model(columns, task=columns.get("task", "query" if index == 0 else "document"))
            embedded, mask = out["token_embeddings"], out["attention_mask"].bool()
            if embedded.shape[1] > width:
                raise ValueError(f"Token embeddings of {embedded.shape[1]} positions, over the model's {width}.")
            tokens.append(F.pad(embedded, (0, 0, 0, width - embedded.shape[1])))
            masks.append(F.pad(mask, (0, width - mask.shape[1]), value=False))
        reps: dict[str, Any] = {"tokens": tokens, "masks": masks}
        if labels is not None:
            reps["labels"] = labels
        return reps

    return embed


def _multi_vector_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    embed = _multi_vector_embedder(trainer)

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        columns = [{COLUMN_KEY: i} for i in range(len(reps["tokens"]))]
        replaced: dict[str, Any] = {"model": _TokenReplay(list(reps["tokens"]), list(reps["masks"]))}
        # Chunking only bounds memory (the same scores); the replayed columns are not batches to chunk.
        replaced.update({k: None for k in ("mini_batch_size", "score_mini_batch_size") if hasattr(loss, k)})
        if hasattr(loss, "gather_across_devices"):
            replaced["gather_across_devices"] = False
        with _attributes(loss, **replaced):
            return _scalar(loss(columns, reps.get("labels")))

    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **_window_world(loss))


def _gathering_modules(loss: nn.Module) -> list[nn.Module]:
    """The loss and its submodules (not the model's) with a `gather_across_devices` setting."""
    model = getattr(loss, "model", None)
    found, stack, seen = [], [loss], set()
    while stack:
        module = stack.pop()
        if id(module) in seen or module is model:
            continue
        seen.add(id(module))
        if "gather_across_devices" in vars(module) or hasattr(type(module), "gather_across_devices"):
            found.append(module)
        stack.extend(child for child in module.children() if child is not None)
    return found


@contextlib.contextmanager
def _no_gather(modules: list[nn.Module]) -> Iterator[None]:
    # The window's embeddings are already every rank's when the loss gathers: it must not gather again.
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(_attributes(module, gather_across_devices=False))
        yield


def _cached_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    """A cached loss over the window: its own `calculate_loss` on the window's embeddings, each column one chunk
    (the coupled mode is the gradient cache, over the whole window)."""
    gathering = _gathering_modules(loss)
    world = {"gather_across_ranks": any(bool(m.gather_across_devices) for m in gathering)}
    if _cached_math(loss) == "tokens":
        embed = _multi_vector_embedder(trainer)

        def token_window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
            with _no_gather(gathering):
                return _scalar(loss.calculate_loss([[t] for t in reps["tokens"]], [[m] for m in reps["masks"]]))

        return CoupledLoss(embed, token_window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **world)

    # Cached losses embed every column in its own forward (`embed_minibatch`).
    embed = _column_embedder(trainer, lambda model, features: [model(f)["sentence_embedding"] for f in features])

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        with _no_gather(gathering):
            return _scalar(loss.calculate_loss([[e] for e in reps["embeddings"]], reps.get("labels")))

    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **world)


class ReplayError(RuntimeError):
    """A loss's `forward` did something the replay on the window's embeddings cannot serve."""


class _ReplayOutput(dict):
    """The stand-in's output: reading any other key than the embeddings is a forward the replay cannot serve."""

    def __init__(self, owner: _ColumnReplay, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.owner = owner

    def __missing__(self, key: str) -> Any:
        raise self.owner.fail(f"reads the model output {key!r} (the replay has the sentence embeddings only)")

    def get(self, key: str, default: Any = None) -> Any:
        return self[key]


class _ColumnReplay(nn.Module):
    """
    Stands in for the model inside a loss's own `forward`: `model(features)` on one of the columns the loss was
    handed returns that column's window embeddings (the coupled mode's leaves, so the gradient reaches them).
    Anything else is recorded and raised as a [`ReplayError`]: features that are not one of the columns (inputs of
    the loss's own), a column embedded twice, extra arguments, a method of the model, another output key.
    Non-callable attributes (`device`, settings) are read from the model.
    """

    def __init__(self, model: nn.Module, embeddings: list[torch.Tensor]) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.served = [0] * len(embeddings)
        self.failure: str | None = None
        self.__dict__["_model"] = model
        self.train(model.training)

    def fail(self, why: str) -> ReplayError:
        if self.failure is None:
            self.failure = why
        return ReplayError(why)

    def forward(self, features: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        if args or kwargs:
            raise self.fail(f"calls the model with more than the features ({len(args)} arguments, {sorted(kwargs)})")
        column = features.get(COLUMN_KEY) if isinstance(features, Mapping) else None
        if column is None:
            raise self.fail(
                "calls the model on inputs that are not one of the columns it was handed (inputs of its own, "
                "or columns merged into one batch)"
            )
        self.served[column] += 1
        if self.served[column] > 1:
            raise self.fail(f"embeds column {column} more than once")
        return _ReplayOutput(self, {"sentence_embedding": self.embeddings[column]})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_model" not in self.__dict__:
                raise
        value = getattr(self.__dict__["_model"], name)
        if callable(value) or isinstance(value, nn.Module):
            raise self.fail(f"uses `model.{name}`")
        return value


def _model_slots(loss: nn.Module, model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where the loss and its submodules hold `model` (not looking inside the model)."""
    slots, stack, seen = [], [loss], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, child in module._modules.items():
            if child is model:
                slots.append((module, name))
            elif child is not None:
                stack.append(child)
    return slots


def _replay_forward(
    loss: nn.Module, embeddings: list[torch.Tensor], columns: list[dict[str, Any]], labels: Any
) -> torch.Tensor:
    """`loss(columns, labels)` with every reference the loss holds to its model replaced by a [`_ColumnReplay`] of
    `embeddings`; the model itself refuses to run meanwhile. Raises [`ReplayError`] for a forward the replay cannot
    serve."""
    model = loss.model
    stand_in = _ColumnReplay(model, list(embeddings))

    def model_called(*args: Any) -> None:
        raise stand_in.fail("calls the model through another reference than `self.model`")

    with contextlib.ExitStack() as stack:
        for module, name in _model_slots(loss, model):
            stack.enter_context(_attributes(module, **{name: stand_in}))
        stack.enter_context(_no_gather(_gathering_modules(loss)))
        with contextlib.suppress(ImportError):
            # The columns carry the collated inputs: merging them into one forward would hand the stand-in new ones.
            from sentence_transformers.base.losses.merged_forward import column_merging_disabled

            stack.enter_context(column_merging_disabled())
        hook = model.register_forward_pre_hook(model_called)
        stack.callback(hook.remove)
        try:
            value = _scalar(loss(columns, labels))
        except ReplayError:
            raise
        except Exception as error:
            if stand_in.failure is not None:
                raise ReplayError(stand_in.failure) from error
            raise
    if stand_in.failure is not None:
        raise ReplayError(stand_in.failure)
    if not any(stand_in.served):
        raise ReplayError("never calls the model")
    return value


def _row_tensor(value: Any, rows: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows and not value.is_floating_point()


def _forward_replay_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    """A loss whose own `forward` runs on the window: the window's embeddings served to it by a [`_ColumnReplay`],
    each column handed over as the window's collated features (the micro-batches' integer tensors padded and
    concatenated, the other entries as the last micro-batch had them), plus the column's index for the stand-in."""
    width = trainer.model.get_max_seq_length() if hasattr(trainer.model, "get_max_seq_length") else None
    metadata: list[dict[str, Any]] = []

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        features, labels = _features(trainer, batch)
        rows = rows_in(features[0])
        carried, metadata[:] = [], []
        for column in features:
            tensors = {}
            for key, value in column.items():
                if width is None or not _row_tensor(value, rows) or (value.dim() > 1 and value.shape[1] > width):
                    continue
                tensors[key] = F.pad(value, (0, width - value.shape[1])) if value.dim() == 2 else value
                if value.dim() > 2:
                    tensors.pop(key)
            carried.append(tensors)
            metadata.append({k: v for k, v in column.items() if k not in tensors})
        reps: dict[str, Any] = {"embeddings": _columns_as_losses_embed(model, features), "features": carried}
        if labels is not None:
            reps["labels"] = labels
        return reps

    def window_loss(reps: Mapping[str, Any], model: nn.Module) -> torch.Tensor:
        columns = []
        for index, tensors in enumerate(reps["features"]):
            column = dict(metadata[index]) if index < len(metadata) else {}
            mask = tensors.get("attention_mask")
            # The window's padding: to its longest row, as one collated batch of it would be.
            length = (
                int(mask.nonzero()[:, 1].max()) + 1 if mask is not None and mask.dim() == 2 and mask.any() else None
            )
            for key, value in tensors.items():
                column[key] = value[:, :length] if length is not None and value.dim() == 2 else value
            column[COLUMN_KEY] = index
            columns.append(column)
        return _replay_forward(loss, list(reps["embeddings"]), columns, reps.get("labels"))

    world = {"gather_across_ranks": any(bool(m.gather_across_devices) for m in _gathering_modules(loss))}
    return CoupledLoss(embed, window_loss, num_items_fn=lambda batch: _rows(trainer, batch), **world)


def verify_forward_replay(trainer: Any, loss: nn.Module, batch: Mapping[str, Any]) -> str | None:
    """
    Check, on one collated micro-batch, that running `loss`'s own `forward` against the stand-in (the embeddings
    computed as the loss computes them) gives the value the loss gives on the model. Runs in eval mode, without a
    graph, and leaves the RNG and the model's mode as they were. Returns `None` when they agree, else why not.

    Example:

    ```python
    >>> verify_forward_replay(trainer, trainer.loss, first_micro_batch) is None  # doctest: +SKIP
    True
    ```
    """
    from ..engine.rng import capture_rng_state, restore_rng_state

    model = loss.model
    was_training, rng = model.training, capture_rng_state()
    try:
        model.eval()
        with torch.no_grad():
            features, labels = _features(trainer, batch)
            expected = _scalar(loss([dict(f) for f in features], labels))
            embeddings = _columns_as_losses_embed(model, [dict(f) for f in features])
            columns = [{**f, COLUMN_KEY: i} for i, f in enumerate(features)]
            got = _replay_forward(loss, embeddings, columns, labels)
    except ReplayError as error:
        return f"its forward {error}"
    except Exception as error:  # noqa: BLE001  (any failure means the replay cannot be trusted)
        return f"replaying its forward raised {type(error).__name__}: {error}"
    finally:
        model.train(was_training)
        restore_rng_state(rng)
    if not torch.is_tensor(expected) or expected.shape != got.shape:
        return f"the replay gives a value of shape {tuple(got.shape)}, the model {getattr(expected, 'shape', None)}"
    tolerance = 1e-4 if got.dtype == torch.float32 or got.dtype == torch.float64 else 2e-2
    if not torch.allclose(got.double(), expected.double(), rtol=tolerance, atol=1e-6):
        return f"the replay gives {float(got):.8g}, the loss on the model {float(expected):.8g}"
    return None


def sentence_transformers_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    """
    The [`~hf_gradaccum.engine.coupled.CoupledLoss`] of a sentence-transformers loss on `trainer`'s collated batches:
    the loss computed once on the embeddings (and labels) of the whole window, micro-batches weighted by rows.
    `loss` must be routed `"coupled"` by [`sentence_transformers_route`].

    Example:

    ```python
    >>> coupled = sentence_transformers_coupled_loss(trainer, trainer.loss)  # doctest: +SKIP
    >>> coupled.accumulate_window(accumulator, trainer.model, micro_batches)  # doctest: +SKIP
    ```
    """
    route, reason = sentence_transformers_route(loss)
    if route != "coupled":
        raise ValueError(f"{type(loss).__name__} is not accumulated in the coupled mode: {reason}.")
    owner = _defining_class(type(loss), "forward").__name__
    if _cached_math(loss) is not None:
        return _cached_coupled_loss(trainer, loss)
    if replays_own_forward(loss):
        return _forward_replay_coupled_loss(trainer, loss)
    if owner in GUIDED_LOSSES:
        return _gist_coupled_loss(trainer, loss)
    if owner in REPLAYED_LOSSES:
        return _replayed_coupled_loss(trainer, loss)
    if owner in MULTI_VECTOR_LOSSES:
        return _multi_vector_coupled_loss(trainer, loss)
    return _embedding_coupled_loss(trainer, loss)


def _rows(trainer: Any, batch: Mapping[str, Any]) -> int:
    features, _ = _features(trainer, batch)
    first = features[0]
    # CrossEncoder columns are lists of texts, tokenised inside the loss.
    return len(first) if isinstance(first, (list, tuple)) else rows_in(first)


# ---------------------------------------------------------------------------------------------------- the trainer
class SentenceTransformersRouting:
    """
    Put in front of a composed `GradAccumTrainer` + `SentenceTransformerTrainer` class by
    [`route_sentence_transformers`] (in front, because sentence-transformers' `compute_loss` does not call its
    parent's). On the first training window it decides the route of `self.loss`; in the coupled route it switches on
    `GradAccumTrainer`'s coupled-loss mode, otherwise the composed class runs as it is (its `compute_loss` is
    sentence-transformers' own), with micro-batches weighted by rows.
    """

    _st_route: str | None = None
    _st_unverified: dict[Any, nn.Module] = {}

    def _decide_route(self) -> str:
        if self._st_route is not None:
            return self._st_route
        loss = self.loss
        self._st_unverified = {}
        if self.args.gradient_accumulation_steps == 1:
            self._st_route, self._st_reason = "plain", "gradient_accumulation_steps=1"
            return self._st_route
        losses = dict(loss) if isinstance(loss, Mapping) else {None: loss}
        decided = {name: sentence_transformers_route(each) for name, each in losses.items()}
        refused = {name: why for name, (r, why) in decided.items() if r == "refused"}
        if refused:
            raise SentenceTransformersLossError(self._message(losses, refused, "refused"))
        # Losses whose own forward is replayed: checked against the model on their first micro-batch.
        self._st_unverified = {
            name: each for name, each in losses.items() if decided[name][0] == "coupled" and replays_own_forward(each)
        }
        return self._install_routes(decided)

    def _install_routes(self, decided: Mapping[Any, tuple[str, str]]) -> str:
        """Set the route of the loss (per dataset for a dict of losses) and the coupled mode it needs."""
        loss = self.loss
        routes = {r for r, _ in decided.values()}
        # Per dataset: a window may mix micro-batches of several datasets, each under its own loss.
        self._st_dataset_routes = {name: r for name, (r, _) in decided.items()}
        self._st_dataset_reasons = {name: why for name, (_, why) in decided.items()}
        if not isinstance(loss, Mapping):
            route, reason = decided[None]
        elif "coupled" in routes:
            route, reason = (
                "coupled",
                "one loss per dataset, each over its own micro-batches of the window: "
                + ("; ".join(f"{name}: {r} ({why})" for name, (r, why) in decided.items())),
            )
        elif "checked" in routes:
            route, reason = "checked", "one loss per dataset, checked on each dataset's micro-batches"
        else:
            route, reason = "item_mean", "one loss per dataset, each a mean over rows"
        if route == "coupled":
            if self.args.auto_find_batch_size:
                raise SentenceTransformersLossError(
                    f"{type(self).__name__}: `auto_find_batch_size=True` cannot be used with {_loss_name(loss)} "
                    "under gradient accumulation: it is accumulated by gradient caching, whose recomputed "
                    "embeddings would draw other dropout masks after an out-of-memory split."
                )
            coupled = (
                _per_dataset_coupled_loss(self, loss, self._st_dataset_routes)
                if isinstance(loss, Mapping)
                else sentence_transformers_coupled_loss(self, loss)
            )
            self.coupled_mode = CoupledWindowMode(coupled, owns_loss=False)
        logger.info("%s: %s accumulates by the %r route (%s).", type(self).__name__, _loss_name(loss), route, reason)
        self._st_route, self._st_reason = route, reason
        return route

    def _verify_replays(self, batches: list[Any]) -> str:
        """Before the first step of a loss whose own forward is replayed: check the replay against the loss on the
        model on its first micro-batch. One that disagrees (or that the replay cannot serve) is routed "checked"
        instead: the split-invariance check decides it. Returns the route."""
        failed = {}
        for name in list(self._st_unverified):
            batch = next((b for b in batches if name is None or _dataset_of(b) == name), None)
            if batch is None:
                continue
            loss = self._st_unverified.pop(name)
            why = verify_forward_replay(self, loss, batch)
            if why is None:
                logger.info(
                    "%s: %s's forward replays exactly on the window's embeddings.",
                    type(self).__name__,
                    _loss_name(loss),
                )
                continue
            logger.warning(
                "%s: %s's own forward cannot be replayed on the window's embeddings (%s); the split-invariance check "
                "decides it instead.",
                type(self).__name__,
                _loss_name(loss),
                why,
            )
            failed[name] = f"its forward could not be replayed on the window's embeddings ({why})"
        if not failed:
            return self._st_route
        decided = {
            name: ("checked", failed[name]) if name in failed else (route, self._st_dataset_reasons[name])
            for name, route in self._st_dataset_routes.items()
        }
        self.coupled_mode = None
        route = self._install_routes(decided)
        if self.coupled_mode is not None:
            self.coupled_mode.window_prefetched(batches)
        return route

    def _message(self, losses: Mapping[Any, Any], why: Mapping[Any, str], route: str) -> str:
        names = ", ".join(type(each).__name__ for name, each in losses.items() if name in why)
        lines = [
            f"{type(self).__name__} cannot train {names} exactly with gradient_accumulation_steps="
            f"{self.args.gradient_accumulation_steps}: " + "; ".join(why.values()) + "."
        ]
        if route == "refused":
            refused = [each for name, each in losses.items() if name in why]
            plain = sorted(
                {CACHED_LOSSES[type(each).__name__] for each in refused if not _is_cross_encoder_loss(type(each))}
            )
            if plain:
                lines.append(
                    f"Fix: use {' / '.join(plain)}: {type(self).__name__} caches gradients over the whole "
                    "accumulation window itself, so the window is the batch of negatives. Or keep the cached loss "
                    "with gradient_accumulation_steps=1 and the large batch as per_device_train_batch_size."
                )
            if any(_is_cross_encoder_loss(type(each)) for each in refused):
                lines.append(f"Fix ({type(self).__name__}): {CROSS_ENCODER_CACHED_FIX}")
        else:
            lines.append(
                "Fix: use a loss GradAccumTrainer routes (MultipleNegativesRankingLoss and its symmetric variant, "
                "GISTEmbedLoss, any loss whose forward is `compute_loss_from_embeddings` of the column "
                "embeddings, or a subclass of one whose own forward embeds its columns once each with `self.model` "
                "and computes the rest from those embeddings); or declare yours with hf_gradaccum.adapters.sentence_transformers."
                "register_sentence_transformers_loss(YourLoss, 'coupled' | 'item_mean'); or train with "
                "gradient_accumulation_steps=1."
            )
        return "\n".join(lines)

    def _check_window(self, batches: list[Any]) -> None:
        """The split-invariance check for the losses with no route: a single loss on the first window; a dict of
        losses on each dataset's micro-batches, the first time a window has any. Stop unless it is exact."""
        if not isinstance(self.loss, Mapping):
            if not getattr(self, "_st_checked", False) and batches:
                self._st_checked = True
                self._check_loss(None, batches)
            return
        checked = self.__dict__.setdefault("_st_checked_datasets", set())
        for name in dict.fromkeys(_dataset_of(b) for b in batches):
            if name in checked or self._st_dataset_routes.get(name) != "checked":
                continue
            checked.add(name)
            self._check_loss(name, [b for b in batches if _dataset_of(b) == name])

    def _check_loss(self, name: Any, batches: list[Any]) -> None:
        from .accumulation_check import check_trainer_window

        result = check_trainer_window(self, batches)
        if result is not None and result.passed:
            return
        losses = {name: self.loss[name]} if name is not None else {None: self.loss}
        if result is None:
            found = "the split-invariance check could not run on the first window (see the log)"
        elif getattr(result, "verdict", None) == "cannot_decide":
            found = f"the split-invariance check cannot decide whether it is exact\n{result.summary()}"
        else:
            found = f"the split-invariance check finds it NOT exact (the window split differently gives another gradient)\n{result.summary()}"
        reason = getattr(self, "_st_reason", "not a loss GradAccumTrainer knows")
        if name is not None:
            reason = f"the loss of dataset {name!r}: {self._st_dataset_reasons[name]}"
        raise SentenceTransformersLossError(
            self._message(losses, dict.fromkeys(losses, f"{reason}, and {found}"), "checked")
        )

    # ------------------------------------------------------------------ Trainer hooks
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        route = self._decide_route()
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._st_unverified and batch_samples:
            route = self._verify_replays(list(batch_samples))
        if route == "checked" or (route == "coupled" and isinstance(self.loss, Mapping)):
            self._check_window(list(batch_samples))
        return batch_samples, num_items

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._decide_route()
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Outside a coupled pass 2 (evaluation, or another route) the loss is sentence-transformers' own.
        if self.coupled_mode is not None and self.coupled_mode.in_pass_two:
            return self.coupled_mode.compute_loss(model, inputs, return_outputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def count_micro_batch_items(self, inputs: dict[str, Any]) -> int:
        # sentence-transformers batches carry `label` (scores, classes) or nothing; every loss here is per row.
        return _rows(self, inputs)


def _dataset_of(batch: Mapping[str, Any]) -> Any:
    return batch.get("dataset_name")


def _item_mean_loss(trainer: Any, loss: nn.Module):
    """A dataset's loss that is a mean over its rows, computed on one micro-batch as the trainer's `compute_loss`
    does (called directly: inside the coupled mode the trainer's `compute_loss` is the surrogate's)."""

    def compute(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        features, labels = _features(trainer, batch)
        extra = {k: batch[k] for k in ("prompt", "task") if batch.get(k) is not None}
        return _scalar(loss(features, labels, **extra))

    return compute


def _per_dataset_coupled_loss(trainer: Any, losses: Mapping[str, nn.Module], routes: Mapping[str, str]):
    """One loss per dataset (sentence-transformers' dict of losses): each dataset's micro-batches of the window
    under its own loss, through the coupled mode for a loss that couples the batch, per micro-batch otherwise (a
    "checked" dataset's loss is checked on its micro-batches before its first step)."""
    from ..engine.grouped_coupled import GroupedCoupledLoss

    per_dataset = {
        name: sentence_transformers_coupled_loss(trainer, loss)
        if routes[name] == "coupled"
        else _item_mean_loss(trainer, loss)
        for name, loss in losses.items()
    }
    return GroupedCoupledLoss(_dataset_of, per_dataset, num_items_fn=lambda batch: _rows(trainer, batch))


def _loss_name(loss: Any) -> str:
    if isinstance(loss, Mapping):
        return "{" + ", ".join(f"{k}: {type(v).__name__}" for k, v in loss.items()) + "}"
    return type(loss).__name__


_ROUTED_CLASSES: dict[type, type] = {}


def route_sentence_transformers(trainer: Any) -> None:
    """
    Called by `GradAccumTrainer.__init__`: when `trainer` is also a `SentenceTransformerTrainer`, give it the class
    `(SentenceTransformersRouting, type(trainer))`, whose hooks route its loss on the first training window (the
    loss may be set after `__init__`, e.g. when `SentenceTransformerTrainer` comes first in the class order).
    Does nothing for any other trainer.

    Example:

    ```python
    >>> class T(GradAccumTrainer, SentenceTransformerTrainer):  # doctest: +SKIP
    ...     pass
    >>> trainer = T(model=model, args=args, train_dataset=pairs, loss=MultipleNegativesRankingLoss(model))  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP  (the whole window is the batch of negatives)
    ```
    """
    if not is_sentence_transformers_trainer(trainer) or isinstance(trainer, SentenceTransformersRouting):
        return
    cls = type(trainer)
    routed = _ROUTED_CLASSES.get(cls)
    if routed is None:
        # Same name and module as the user's class, so that messages and saved model cards name it.
        routed = type(cls.__name__, (SentenceTransformersRouting, cls), {"__module__": cls.__module__})
        routed.__qualname__ = cls.__qualname__
        _ROUTED_CLASSES[cls] = routed
    trainer.__class__ = routed
