"""sentence-transformers' `SentenceTransformerTrainer` composed with [`GradAccumTrainer`]: exact without configuration.

Many sentence-transformers losses couple the batch: with in-batch negatives (`MultipleNegativesRankingLoss`, its
symmetric variant, `GISTEmbedLoss`) every sample is a negative for every other, and CoSENT/AnglE or the batch-hard
triplet losses compare all pairs of the batch. Accumulating each micro-batch's own loss trains a weaker objective than
the large batch, whatever the weighting. Composing `GradAccumTrainer` with `SentenceTransformerTrainer` (either class
order) therefore routes the loss, on the first training window, to one of:

- **coupled** (gradient caching, `engine/coupled.py`): for a loss that computes its value from the column
  embeddings (its `compute_loss_from_embeddings`, fed the whole window's embeddings and labels, so its own
  similarity function, scale, directions and hardness settings apply) and for `GISTEmbedLoss` (its own `forward`
  replayed on the window's model and guide embeddings). Micro-batches are weighted by rows. Exact.
- **refused**: a cached loss (`Cached*`) under accumulation: it caches within one micro-batch only, so its negatives
  are the micro-batch's. The error names the non-cached loss to use instead.
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
from torch import nn

from ..engine.coupled import CoupledLoss, rows_in
from .compositions import CACHED_LOSSES, EMBEDDING_LOSSES, GUIDED_LOSSES
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


class SentenceTransformersLossError(ValueError):
    """A sentence-transformers loss that `GradAccumTrainer` cannot accumulate exactly, or could not show exact."""


# ---------------------------------------------------------------------------------------------------- detection
def is_sentence_transformers_trainer(trainer: Any) -> bool:
    """Whether `trainer` is a sentence-transformers `SentenceTransformerTrainer` (without importing the package)."""
    module = sys.modules.get("sentence_transformers")
    if module is None:
        return False
    trainer_cls = getattr(module, "SentenceTransformerTrainer", None)
    return trainer_cls is not None and isinstance(trainer, trainer_cls)


def register_sentence_transformers_loss(loss_cls: type, route: str) -> None:
    """
    Declare how a sentence-transformers loss class accumulates under `GradAccumTrainer`, instead of the first-window
    check that an unknown loss gets:

    - `"coupled"`: the loss has `compute_loss_from_embeddings(embeddings, labels)` and its `forward` is exactly
      "embed every column with `self.model`, then that method": gradient caching over the window (exact);
    - `"item_mean"`: the loss is a mean over independent rows (no sample's loss depends on another sample):
      plain accumulation weighted by rows (exact).

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
            return _REGISTERED[cls], f"{cls.__name__} registered as {_REGISTERED[cls]!r}"
    if loss_cls.__name__ in CACHED_LOSSES:
        return "refused", "it caches gradients within one micro-batch, so its negatives are the micro-batch's only"
    forward_owner = _defining_class(loss_cls, "forward")
    owner = forward_owner.__name__ if forward_owner is not None else ""
    if owner in GUIDED_LOSSES:
        return "coupled", f"{owner}'s forward replayed on the window's model and guide embeddings"
    if owner in EMBEDDING_LOSSES and callable(getattr(loss, "compute_loss_from_embeddings", None)):
        return "coupled", f"{owner}.compute_loss_from_embeddings on the window's embeddings"
    return "checked", "not a loss GradAccumTrainer knows how to accumulate"


# ---------------------------------------------------------------------------------------------------- coupled losses
def _features(trainer: Any, batch: Mapping[str, Any]) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """The column features and labels of a collated batch, as `SentenceTransformerTrainer.compute_loss` splits it."""
    features, labels = trainer.collect_features(dict(batch))
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


def _embedding_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    first_only = _defining_class(type(loss), "forward").__name__.startswith("Batch")

    def embed(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        features, labels = _features(trainer, batch)
        reps: dict[str, Any] = {"embeddings": _embed_columns(model, features, first_only)}
        if labels is not None:
            reps["labels"] = labels
        return reps

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
    if _defining_class(type(loss), "forward").__name__ in GUIDED_LOSSES:
        return _gist_coupled_loss(trainer, loss)
    return _embedding_coupled_loss(trainer, loss)


def _rows(trainer: Any, batch: Mapping[str, Any]) -> int:
    features, _ = _features(trainer, batch)
    return rows_in(features[0])


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

    def _decide_route(self) -> str:
        if self._st_route is not None:
            return self._st_route
        route, reason, loss = "plain", "gradient_accumulation_steps=1", self.loss
        if self.args.gradient_accumulation_steps > 1:
            losses = dict(loss) if isinstance(loss, Mapping) else {None: loss}
            decided = {name: sentence_transformers_route(each) for name, each in losses.items()}
            refused = {name: why for name, (r, why) in decided.items() if r == "refused"}
            if refused:
                raise SentenceTransformersLossError(self._message(losses, refused, "refused"))
            routes = {r for r, _ in decided.values()}
            if isinstance(loss, Mapping) and routes != {"item_mean"}:
                # A window may mix batches of several datasets, each with its own loss: no single window loss.
                route, reason = "checked", "one loss per dataset (a dict of losses)"
            else:
                route, reason = decided[next(iter(decided))]
        if route == "coupled":
            if self.args.auto_find_batch_size:
                raise SentenceTransformersLossError(
                    f"{type(self).__name__}: `auto_find_batch_size=True` cannot be used with {type(loss).__name__} "
                    "under gradient accumulation: it is accumulated by gradient caching, whose recomputed "
                    "embeddings would draw other dropout masks after an out-of-memory split."
                )
            self.coupled_mode = CoupledWindowMode(sentence_transformers_coupled_loss(self, loss), owns_loss=False)
        logger.info("%s: %s accumulates by the %r route (%s).", type(self).__name__, _loss_name(loss), route, reason)
        self._st_route, self._st_reason = route, reason
        return route

    def _message(self, losses: Mapping[Any, Any], why: Mapping[Any, str], route: str) -> str:
        names = ", ".join(type(each).__name__ for name, each in losses.items() if name in why)
        lines = [
            f"{type(self).__name__} cannot train {names} exactly with gradient_accumulation_steps="
            f"{self.args.gradient_accumulation_steps}: " + "; ".join(why.values()) + "."
        ]
        if route == "refused":
            plain = sorted(
                {CACHED_LOSSES[type(each).__name__] for each in losses.values()} & set(CACHED_LOSSES.values())
            )
            lines.append(
                f"Fix: use {' / '.join(plain) or 'the non-cached loss'}: {type(self).__name__} caches gradients over "
                "the whole accumulation window itself, so the window is the batch of negatives. Or keep the cached "
                "loss with gradient_accumulation_steps=1 and the large batch as per_device_train_batch_size."
            )
        else:
            lines.append(
                "Fix: use a loss GradAccumTrainer routes (MultipleNegativesRankingLoss and its symmetric variant, "
                "GISTEmbedLoss, or any loss whose forward is `compute_loss_from_embeddings` of the column "
                "embeddings); or declare yours with hf_gradaccum.adapters.sentence_transformers."
                "register_sentence_transformers_loss(YourLoss, 'coupled' | 'item_mean'); or train with "
                "gradient_accumulation_steps=1."
            )
        return "\n".join(lines)

    def _check_first_window(self, batches: list[Any]) -> None:
        """The split-invariance check on the first window for a loss with no route: stop unless it is exact."""
        from .accumulation_check import check_trainer_window

        if getattr(self, "_st_checked", False) or not batches:
            return
        self._st_checked = True
        result = check_trainer_window(self, batches)
        if result is not None and result.passed:
            return
        losses = dict(self.loss) if isinstance(self.loss, Mapping) else {None: self.loss}
        if result is None:
            found = "the split-invariance check could not run on the first window (see the log)"
        elif getattr(result, "verdict", None) == "cannot_decide":
            found = f"the split-invariance check cannot decide whether it is exact\n{result.summary()}"
        else:
            found = f"the split-invariance check finds it NOT exact (the window split differently gives another gradient)\n{result.summary()}"
        reason = getattr(self, "_st_reason", "not a loss GradAccumTrainer knows")
        raise SentenceTransformersLossError(
            self._message(losses, dict.fromkeys(losses, f"{reason}, and {found}"), "checked")
        )

    # ------------------------------------------------------------------ Trainer hooks
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        route = self._decide_route()
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if route == "checked":
            self._check_first_window(list(batch_samples))
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
