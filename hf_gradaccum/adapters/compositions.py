"""One registry of the trainers `GradAccumTrainer` composes with: for each (trainer class, loss), how it accumulates.

Every entry says one of four things:

- **items**: the loss is a mean over independent items (tokens, rows, pairs, completions); each micro-batch is weighted
  by how many it has and the window is divided by all of them, which is the large batch's mean;
- **window statistic**: the loss also uses a statistic of the whole batch (a baseline, a normaliser); it is computed
  once over the window and every micro-batch uses it;
- **coupled**: every sample's loss depends on the others (in-batch negatives); the window runs through the
  coupled-loss mode (gradient caching), so the loss sees the whole window;
- **refused**: no weighting of micro-batches reproduces the large batch; construction stops with the reason and the
  fix, before any work, when `gradient_accumulation_steps > 1`.

Keys are class *names*, so that nothing is imported for a trainer that is not in use; a loss of `"*"` stands for every
loss type of that trainer that has no entry of its own. The tables of the feature slices that carry out an entry
(`adapters/trl_grpo.py` for what each GRPO loss averages over, `adapters/sentence_transformers.py` for the losses
routed to the coupled mode) are the source of their rows here, so the listing cannot disagree with what runs.

A composed trainer that is not in the registry (a `Trainer` subclass from another installed package) is checked on
its first window by default (`check_unknown_compositions`): the split-invariance check runs, and training stops
before the first optimizer step, naming the trainer, its loss and the fix, unless accumulation is found exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .composed_class import library_trainer, nearest_trainer_named
from .composition_error import CompositionError
from .trl_dpo_sorted import SORTED_LOSS_TYPES
from .trl_generating import REGISTRY_ROWS as GENERATING_ROWS
from .trl_grpo import LOSS_ITEMS
from .trl_loss_terms import LOSS_TERMS

__all__ = [
    "HOW",
    "Accumulation",
    "CompositionError",
    "REGISTRY",
    "composition_entry",
    "composition_table",
    "refuse_unaccumulable_losses",
    "register_composition",
    "unknown_composed_trainer",
]

HOW = ("items", "window statistic", "coupled", "refused")


@dataclass(frozen=True)
class Accumulation:
    """
    How one (trainer, loss) accumulates under `GradAccumTrainer`.

    Args:
        how (`str`): one of `"items"`, `"window statistic"`, `"coupled"`, `"refused"`.
        what (`str`): the items counted, the statistic computed over the window, or why it is refused.
        fix (`str`, *optional*): for `"refused"`, what to use instead.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.compositions import REGISTRY
    >>> REGISTRY["DPOTrainer", "aot"].how
    'window statistic'
    ```
    """

    how: str
    what: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"`how` must be one of {list(HOW)}, got {self.how!r}.")
        if self.how == "refused" and not self.fix:
            raise ValueError("A refused entry needs `fix`: what to use instead.")


_MODEL_MEAN = "the model's own mean: non-`-100` label tokens (shifted for causal LMs), one per row for sequence labels"
_GA1 = "`gradient_accumulation_steps=1` with the batch you want"


def _grpo_rows() -> dict[tuple[str, str], Accumulation]:
    rows = {}
    for (trainer, loss_type), items in LOSS_ITEMS.items():
        detail = items.items
        if items.rescales_num_items:
            detail += " (TRL's `num_items_in_batch` presented as the micro-batch's own; see adapters/trl_grpo.py)"
        rows[trainer, loss_type or "*"] = Accumulation("items", detail)
    if ("GRPOTrainer", "*") not in rows:
        rows["GRPOTrainer", "*"] = Accumulation(
            "refused",
            "a loss type not in the table of what each GRPO loss averages over",
            "Use one of " + ", ".join(repr(t) for (n, t) in LOSS_ITEMS if n == "GRPOTrainer") + ".",
        )
    return rows


def _loss_term_rows() -> dict[tuple[str, str], Accumulation]:
    rows = {}
    for term in LOSS_TERMS:
        rows[term.trainer, term.option] = Accumulation(
            "items",
            f"{term.primary}, and {term.term} over {term.items}: each term weighted by its own count over the window "
            "(adapters/trl_loss_terms.py)",
        )
    return rows


# Loss classes (by name, so that nothing is imported before sentence-transformers is) whose `forward` is exactly
# "embed every column with `self.model`, then `compute_loss_from_embeddings(embeddings, labels)`". A subclass that
# keeps one of these `forward`s is routed too; one that overrides `forward` is not (its forward may do more).
EMBEDDING_LOSSES = (
    "MultipleNegativesRankingLoss",
    "CoSENTLoss",
    "AnglELoss",
    "CosineSimilarityLoss",
    "ContrastiveLoss",
    "OnlineContrastiveLoss",
    "TripletLoss",
    "MarginMSELoss",
    "DistillKLDivLoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchHardSoftMarginTripletLoss",
    "BatchSemiHardTripletLoss",
)
# Embedding losses that are a mean over independent rows when built with the settings `row_mean_settings` accepts:
# plain accumulation weighted by rows is exact for them, without the coupled mode's extra forward per micro-batch.
ROW_MEAN_EMBEDDING_LOSSES = (
    "CosineSimilarityLoss",
    "ContrastiveLoss",
    "TripletLoss",
    "MarginMSELoss",
    "DistillKLDivLoss",
)
# `forward` runs the guide model too: replayed on the window's embeddings by `_gist_coupled_loss`.
GUIDED_LOSSES = ("GISTEmbedLoss",)
# `forward` embeds the columns with `self.model` (sentence-transformers' `embed_columns`) and computes everything
# else from those embeddings (SpladeLoss: its ranking loss plus the FLOPS regularisers, batch means of the
# embeddings): replayed on the window's embeddings by `_replayed_coupled_loss`.
REPLAYED_LOSSES = ("SpladeLoss",)
# MultiVectorEncoder losses whose `forward` embeds the columns token by token with `self.model` and computes
# everything else from those token embeddings and their scoring masks: replayed by `_multi_vector_coupled_loss`.
MULTI_VECTOR_LOSSES = ("MultiVectorMultipleNegativesRankingLoss",)
# Gradient caching within one micro-batch: under accumulation their negatives are the micro-batch's only, unless
# routed by `CACHED_COUPLED_LOSSES`.
CACHED_LOSSES = {
    "CachedMultipleNegativesRankingLoss": "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss": "MultipleNegativesSymmetricRankingLoss",
    "CachedGISTEmbedLoss": "GISTEmbedLoss",
    "CachedSpladeLoss": "SpladeLoss",
    "CachedMultiVectorMultipleNegativesRankingLoss": "MultiVectorMultipleNegativesRankingLoss",
}
# Cached losses whose `calculate_loss(embeddings...)` is the whole loss computed from the column embeddings: the
# coupled mode (itself gradient caching, over the window) feeds it the window's embeddings, which is the cached loss
# on the large batch (its `mini_batch_size` chunks only bound memory). `CachedGISTEmbedLoss` also runs its guide model
# inside, and CrossEncoder's cached loss scores (query, document) pairs inside: both stay refused.
CACHED_COUPLED_LOSSES = (
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "CachedSpladeLoss",
    "CachedMultiVectorMultipleNegativesRankingLoss",
)
# The trainer of each cached loss that is not a SentenceTransformer loss.
CACHED_LOSS_TRAINERS = {
    "CachedSpladeLoss": "SparseEncoderTrainer",
    "CachedMultiVectorMultipleNegativesRankingLoss": "MultiVectorEncoderTrainer",
}
# CrossEncoder's cached in-batch-negatives loss: its non-cached MultipleNegativesRankingLoss is no way out, since it
# pairs each query with the other rows' documents inside the loss, which no route replays over the window (the
# first-window check refuses it too).
CROSS_ENCODER_CACHED_FIX = (
    "Keep the cached loss with gradient_accumulation_steps=1 and the large batch as per_device_train_batch_size "
    "(its mini_batch_size already bounds the memory). Its non-cached MultipleNegativesRankingLoss is no alternative: "
    "CrossEncoderTrainer's in-batch negatives are scored as (query, other row's document) pairs inside the loss, "
    "which GradAccumTrainer does not replay over the window, so it is refused as well. BinaryCrossEntropyLoss on "
    "labelled pairs (e.g. mined hard negatives) accumulates exactly; ListNetLoss over (query, [documents]) rows is "
    "checked on the first window and trains when the check finds it exact."
)
# CrossEncoder losses that are a mean over independent rows (pairs): plain accumulation weighted by rows.
CROSS_ENCODER_ROW_LOSSES = ("BinaryCrossEntropyLoss", "CrossEntropyLoss", "MSELoss", "MarginMSELoss")
# sentence-transformers' trainers (6.x: all subclasses of its `BaseTrainer`; 5.x has the first three).
SENTENCE_TRANSFORMERS_TRAINERS = (
    "SentenceTransformerTrainer",
    "CrossEncoderTrainer",
    "SparseEncoderTrainer",
    "MultiVectorEncoderTrainer",
)


def _sentence_transformers_rows() -> dict[tuple[str, str], Accumulation]:
    rows = {}
    coupled = Accumulation("coupled", "the window's embeddings through the loss (rows weighted)")
    for loss in (*EMBEDDING_LOSSES, *GUIDED_LOSSES):
        rows["SentenceTransformerTrainer", loss] = coupled
    for loss in ROW_MEAN_EMBEDDING_LOSSES:
        rows["SentenceTransformerTrainer", loss] = Accumulation(
            "items", "rows, when built as a mean over rows (its default settings); other settings: coupled"
        )
    for loss in REPLAYED_LOSSES:
        rows["SparseEncoderTrainer", loss] = coupled
    for loss in MULTI_VECTOR_LOSSES:
        rows["MultiVectorEncoderTrainer", loss] = coupled
    for loss in CROSS_ENCODER_ROW_LOSSES:
        rows["CrossEncoderTrainer", loss] = Accumulation("items", "rows (query-document pairs)")
    for cached, plain in CACHED_LOSSES.items():
        trainer = CACHED_LOSS_TRAINERS.get(cached, "SentenceTransformerTrainer")
        if cached in CACHED_COUPLED_LOSSES:
            rows[trainer, cached] = Accumulation(
                "coupled",
                "the window's embeddings through its `calculate_loss` (the window is its cache; rows weighted)",
            )
            continue
        rows[trainer, cached] = Accumulation(
            "refused",
            "it caches gradients within one micro-batch, so its negatives are the micro-batch's only",
            f"Use `{plain}`: composed with GradAccumTrainer the whole window is its batch of negatives.",
        )
    rows["CrossEncoderTrainer", "CachedMultipleNegativesRankingLoss"] = Accumulation(
        "refused",
        "it caches gradients within one micro-batch, so its negatives are the micro-batch's only",
        CROSS_ENCODER_CACHED_FIX,
    )
    for trainer in SENTENCE_TRANSFORMERS_TRAINERS:
        rows[trainer, "*"] = Accumulation(
            "items",
            "rows, after the split-invariance check on the first window finds the loss exact (else refused); "
            "`register_sentence_transformers_loss` declares a loss instead",
        )
    return rows


# (trainer class name, loss type / loss class name / "*") -> how it accumulates.
REGISTRY: dict[tuple[str, str], Accumulation] = {
    ("Trainer", "*"): Accumulation("items", _MODEL_MEAN),
    ("Seq2SeqTrainer", "*"): Accumulation("items", _MODEL_MEAN),
    ("SFTTrainer", "*"): Accumulation("items", "label tokens (completion-only and assistant-only masks included)"),
    ("DPOTrainer", "*"): Accumulation("items", "pairs (every per-pair loss type)"),
    **{
        ("DPOTrainer", loss): Accumulation(
            "window statistic",
            "pairs, with the log-ratios sorted over the window (a forward-only window pass; "
            "adapters/trl_dpo_sorted.py)",
        )
        for loss in SORTED_LOSS_TYPES
    },
    ("RewardTrainer", "*"): Accumulation("items", "pairs"),
    ("KTOTrainer", "apo_zero_unpaired"): Accumulation("items", "completions (desirable and undesirable)"),
    ("KTOTrainer", "kto"): Accumulation(
        "window statistic",
        "completions, with the KL baseline over the window's mismatched pairs (rotated within the window on all "
        "ranks, one forward-only pass; adapters/trl_kto.py)",
    ),
    ("GKDTrainer", "*"): Accumulation(
        "items",
        "label tokens of the batch the loop hands over, before any on-policy or `seq_kd` generation: stock GKD divides "
        "the divergence over the generated tokens by that count (`num_items_in_batch`), which is handed to it as the "
        "micro-batch's own",
    ),
    ("TPOTrainer", "*"): Accumulation("items", "triples of one prompt (chosen, rejected and reference rows)"),
    ("CPOTrainer", "*"): Accumulation("items", "pairs (every loss type; `cpo_alpha=0`)"),
    ("BCOTrainer", "*"): Accumulation(
        "refused",
        "its reward baseline (`delta`) is a running mean updated with each batch's rewards just before that batch's "
        "loss uses it, so micro-batch k would use a baseline that has seen only the first k micro-batches' rewards",
        f"Use {_GA1}.",
    ),
    **_grpo_rows(),
    ("GRPOTrainer", "top_entropy_quantile"): Accumulation(
        "window statistic",
        "the loss type's items, with the entropy threshold the window's quantile over all ranks (a forward-only "
        "window pass at its first loss; adapters/trl_grpo_entropy.py)",
    ),
    **_loss_term_rows(),
    # TRL's trainers that generate or rebuild their batch in a micro-step (adapters/trl_generating.py).
    **{key: Accumulation(*row) for key, row in GENERATING_ROWS.items()},
    **_sentence_transformers_rows(),
}


def register_composition(trainer_name: str, loss: str, how: str, what: str, fix: str | None = None) -> None:
    """
    Declare how a composed trainer's loss accumulates, instead of the first-window check an unknown composition gets.
    Only `"items"` (a mean over independent items, which `count_micro_batch_items` counts) and `"refused"` can be
    declared: the window statistic and coupled rows need code of their own.

    Args:
        trainer_name (`str`): the trainer class's name, e.g. `"ORPOTrainer"`.
        loss (`str`): its `args.loss_type`, or `"*"` for all of them.
        how (`str`): `"items"` or `"refused"`.
        what (`str`): the items its loss is a mean over, or why it cannot be accumulated.
        fix (`str`, *optional*): with `"refused"`, what to use instead.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.compositions import REGISTRY, register_composition
    >>> register_composition("MyPairTrainer", "*", "items", "pairs")
    >>> REGISTRY["MyPairTrainer", "*"].how
    'items'
    ```
    """
    if how not in ("items", "refused"):
        raise ValueError(f"`how` must be 'items' or 'refused' for a registered composition, got {how!r}.")
    if not isinstance(trainer_name, str) or not isinstance(loss, str):
        raise TypeError(f"`trainer_name` and `loss` must be strings, got {trainer_name!r} and {loss!r}.")
    REGISTRY[trainer_name, loss] = Accumulation(how, what, fix)


def _loss_keys(trainer: Any, trainer_name: str) -> list[str]:
    """The loss names that select a row for `trainer_name`: its loss types, or its loss module's class names."""
    if trainer_name in SENTENCE_TRANSFORMERS_TRAINERS:
        loss = getattr(trainer, "loss", None)
        losses = list(loss.values()) if isinstance(loss, dict) else [loss]
        return [type(item).__name__ for item in losses if item is not None]
    if trainer_name in ("RLOOTrainer", "GMPOTrainer", "DistillationTrainer", "SDFTTrainer", "GKDTrainer"):
        return ["*"]
    loss_types = getattr(trainer.args, "loss_type", None)
    if isinstance(loss_types, str):
        keys = [loss_types]
    else:
        keys = [str(t) for t in loss_types] if loss_types else ["*"]
    if trainer_name == "GRPOTrainer" and getattr(trainer.args, "top_entropy_quantile", 1.0) < 1.0:
        keys.append("top_entropy_quantile")
    for term in LOSS_TERMS:
        if term.trainer == trainer_name and term.option != "*" and term.option not in keys and term.active(trainer):
            keys.append(term.option)
    return keys


def composition_entry(trainer: Any) -> tuple[str, list[tuple[str, Accumulation]]] | None:
    """
    The registry's rows for `trainer`: `(trainer class name, [(loss, Accumulation), ...])` for the nearest class in its
    MRO with an entry, not looking past a library class without one ([`nearest_trainer_named`]: a subclass that
    changes the loss is a trainer of its own), or `None`.

    Example:

    ```python
    >>> from hf_gradaccum.adapters.compositions import composition_entry
    >>> composition_entry(trainer)  # doctest: +SKIP  (a GradAccumTrainer composed with DPOTrainer, loss 'sigmoid')
    ('DPOTrainer', [('sigmoid', Accumulation(how='items', what='pairs (every per-pair loss type)', fix=None))])
    ```
    """
    name = nearest_trainer_named(trainer, {name for name, _ in REGISTRY})
    if name is None:
        return None
    rows = []
    for loss in _loss_keys(trainer, name):
        entry = REGISTRY.get((name, loss)) or REGISTRY.get((name, "*"))
        if entry is not None:
            rows.append((loss, entry))
    return name, rows


def refuse_unaccumulable_losses(trainer: Any) -> None:
    """
    Raise a [`CompositionError`] (a `ValueError`) naming the trainer, the loss, why and the fix when the registry
    refuses `trainer`'s loss under accumulation. Does nothing with `gradient_accumulation_steps=1`.
    """
    if trainer.args.gradient_accumulation_steps == 1:
        return
    found = composition_entry(trainer)
    if found is None:
        return
    name, rows = found
    if name in SENTENCE_TRANSFORMERS_TRAINERS:
        # Its loss may be set after `__init__` (with SentenceTransformerTrainer first in the class order): the
        # routing refuses these rows on the first window, before any step (adapters/sentence_transformers.py).
        return
    refused = [(loss, entry) for loss, entry in rows if entry.how == "refused"]
    if refused:
        named = [loss for loss, _ in refused if loss != "*"]
        subject = f"{name} with loss {named}" if named else name
        why = "; ".join(f"{loss!r} {entry.what}" if loss != "*" else entry.what for loss, entry in refused)
        raise CompositionError(
            f"{subject} cannot be accumulated exactly: {why}, so no weighting of micro-batches equals the "
            f"large-batch loss. {refused[0][1].fix}"
        )


def unknown_composed_trainer(trainer: Any) -> str | None:
    """
    The name of the `Trainer` subclass from another installed package (not transformers, not this one) that
    `trainer` composes with, when the registry has no row for it; `None` when the nearest such class in the MRO is
    known, or there is none. Only the nearest counts: a subclass of a known trainer that is not itself in the registry
    (it may change the loss) is unknown. The user's own subclasses (code not installed as a package) are the user's loss, not a
    composition, and are looked through.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.adapters.compositions import unknown_composed_trainer
    >>> unknown_composed_trainer(GradAccumTrainer.__new__(GradAccumTrainer)) is None
    True
    ```
    """
    cls = library_trainer(trainer)
    if cls is None or cls.__module__.split(".")[0] == "transformers":
        return None
    return None if cls.__name__ in {name for name, _ in REGISTRY} else cls.__name__


def composition_table() -> str:
    """
    The registry as a Markdown table (what `hf-gradaccum compositions` prints).

    Example:

    ```python
    >>> from hf_gradaccum.adapters.compositions import composition_table
    >>> print(composition_table().splitlines()[0])
    | trainer | loss | accumulates by | what |
    ```
    """
    lines = ["| trainer | loss | accumulates by | what |", "|---|---|---|---|"]
    for (trainer, loss), entry in REGISTRY.items():
        what = entry.what + (f" Fix: {entry.fix}" if entry.fix else "")
        lines.append(f"| {trainer} | {loss} | {entry.how} | {what} |")
    return "\n".join(lines)
