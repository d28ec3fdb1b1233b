"""A loss subclass that overrides `forward`: its own `forward` run on the window against a stand-in for the model that
hands it the window's embeddings, checked against the loss on the model before the first step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.window_losses.coupled import CoupledLoss, rows_in
from .embedding_losses import (
    COLUMN_KEY,
    _attributes,
    _columns_as_losses_embed,
    _features,
    _gathering_modules,
    _no_gather,
    _rows,
    _scalar,
)

logger = logging.getLogger(__name__)


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
    from ...engine.rng import capture_rng_state, restore_rng_state

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
