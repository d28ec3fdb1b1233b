"""sentence-transformers' trainers composed with [`GradAccumTrainer`]: exact without configuration.

Every trainer sentence-transformers ships (`SentenceTransformerTrainer`, `CrossEncoderTrainer`,
`SparseEncoderTrainer`, `MultiVectorEncoderTrainer`; in 6.x all subclasses of its `BaseTrainer`) is routed here.

Many sentence-transformers losses couple the batch: with in-batch negatives (`MultipleNegativesRankingLoss`, its
symmetric variant, `GISTEmbedLoss`) every sample is a negative for every other, and CoSENT/AnglE or the batch-hard
triplet losses compare all pairs of the batch. Accumulating each micro-batch's own loss trains a weaker objective than
the large batch, whatever the weighting. Composing `GradAccumTrainer` with `SentenceTransformerTrainer` (either class
order) therefore routes the loss, on the first training window, to one of:

- **coupled** (gradient caching, `engine/window_losses/coupled.py`): for a loss that computes its value from the column
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

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...engine.window_losses.coupled import CoupledLoss
from ...losses.coupled import CoupledWindowMode
from .embedding_losses import (
    _cached_coupled_loss,
    _embedding_coupled_loss,
    _features,
    _gist_coupled_loss,
    _multi_vector_coupled_loss,
    _replayed_coupled_loss,
    _rows,
    _scalar,
)
from .forward_replay import _forward_replay_coupled_loss, verify_forward_replay
from .loss_classes import (
    CACHED_LOSSES,
    CROSS_ENCODER_CACHED_FIX,
    GUIDED_LOSSES,
    MULTI_VECTOR_LOSSES,
    REPLAYED_LOSSES,
)
from .routes import (
    SentenceTransformersLossError,
    _cached_math,
    _defining_class,
    _is_cross_encoder_loss,
    is_sentence_transformers_trainer,
    register_sentence_transformers_loss,
    replays_own_forward,
    sentence_transformers_route,
)

__all__ = [
    "SentenceTransformersLossError",
    "is_sentence_transformers_trainer",
    "register_sentence_transformers_loss",
    "route_sentence_transformers",
    "sentence_transformers_coupled_loss",
    "sentence_transformers_route",
]

logger = logging.getLogger(__name__)


def sentence_transformers_coupled_loss(trainer: Any, loss: nn.Module) -> CoupledLoss:
    """
    The [`~hf_gradaccum.engine.window_losses.coupled.CoupledLoss`] of a sentence-transformers loss on `trainer`'s collated batches:
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
                "and computes the rest from those embeddings); or declare yours with hf_gradaccum.integrations.sentence_transformers.routing."
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
        from ...losses.accumulation_check import check_trainer_window

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
    from ...engine.window_losses.grouped_coupled import GroupedCoupledLoss

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
