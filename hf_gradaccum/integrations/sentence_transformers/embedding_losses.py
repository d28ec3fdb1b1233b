"""A sentence-transformers loss over the whole window, built from the loss's own code: its
`compute_loss_from_embeddings` (or the cached losses' `calculate_loss`) fed every column embedding of the window, and
the losses whose `forward` is replayed on them (GIST's guide, SPLADE, multi-vector)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.window_losses.coupled import CoupledLoss, rows_in
from .routes import _cached_math, _defining_class

logger = logging.getLogger(__name__)

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


def _rows(trainer: Any, batch: Mapping[str, Any]) -> int:
    features, _ = _features(trainer, batch)
    first = features[0]
    # CrossEncoder columns are lists of texts, tokenised inside the loss.
    return len(first) if isinstance(first, (list, tuple)) else rows_in(first)
