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
(`integrations/trl/grpo.py` for what each GRPO loss averages over, `integrations/sentence_transformers/routing.py` for the losses
routed to the coupled mode) are the source of their rows here, so the listing cannot disagree with what runs.

The registry is also the one door from `GradAccumTrainer` into this folder: the window features of the composed
trainers (KTO's window pairing and baseline, GRPO's and the generating trainers' counting, the loss terms, DPO's sorted
losses, GRPO's entropy quantile, sentence-transformers' routing) are imported from here, so the Trainer depends on
this module alone and a new integration adds its rows and its feature here.

A composed trainer that is not in the registry (a `Trainer` subclass from another installed package) is checked on
its first window by default (`check_unknown_compositions`): the split-invariance check runs, and training stops
before the first optimizer step, naming the trainer, its loss and the fix, unless accumulation is found exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.arguments import gradaccum_option
from ..losses.composed_class import library_trainer, nearest_trainer_named
from ..losses.composition_error import CompositionError
from ..losses.counting import divides_by_handed_count, hands_batch_to_loss_unchanged, refuse_rebuilt_micro_batches
from .sentence_transformers.loss_classes import (
    CACHED_COUPLED_LOSSES,
    CACHED_LOSS_TRAINERS,
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
from .sentence_transformers.routing import route_sentence_transformers
from .trl.dpo_sorted import SORTED_LOSS_TYPES, WindowSortedLoss, window_sorted_loss_for
from .trl.generating import REGISTRY_ROWS as GENERATING_ROWS
from .trl.generating import handed_window_share, rebuilt_batch_accumulation_for
from .trl.grpo import LOSS_ITEMS, GenerationBatchAccumulation, generation_accumulation_for
from .trl.grpo_entropy import WindowEntropyQuantile, window_entropy_quantile_for
from .trl.kto import WindowKLBaseline, install_window_pairing, window_kl_baseline_for
from .trl.loss_terms import LOSS_TERMS, WindowTermWeights, window_term_weights_for

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
    # What `GradAccumTrainer` asks of the integrations (each returns `None`, or does nothing, for other trainers).
    "GenerationBatchAccumulation",
    "WindowEntropyQuantile",
    "WindowKLBaseline",
    "WindowSortedLoss",
    "WindowTermWeights",
    "generation_accumulation_for",
    "handed_window_share",
    "install_window_pairing",
    "rebuilt_batch_accumulation_for",
    "route_sentence_transformers",
    "window_entropy_quantile_for",
    "window_kl_baseline_for",
    "window_sorted_loss_for",
    "window_term_weights_for",
    "refuse_under_deepspeed",
    "attach_composed_losses",
    "unknown_composition_error",
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
    >>> from hf_gradaccum.integrations.registry import REGISTRY
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
            detail += " (TRL's `num_items_in_batch` presented as the micro-batch's own; see integrations/trl/grpo.py)"
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
            "(integrations/trl/loss_terms.py)",
        )
    return rows


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
            "integrations/trl/dpo_sorted.py)",
        )
        for loss in SORTED_LOSS_TYPES
    },
    ("RewardTrainer", "*"): Accumulation("items", "pairs"),
    ("KTOTrainer", "apo_zero_unpaired"): Accumulation("items", "completions (desirable and undesirable)"),
    ("KTOTrainer", "kto"): Accumulation(
        "window statistic",
        "completions, with the KL baseline over the window's mismatched pairs (rotated within the window on all "
        "ranks, one forward-only pass; integrations/trl/kto.py)",
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
        "window pass at its first loss; integrations/trl/grpo_entropy.py)",
    ),
    **_loss_term_rows(),
    # TRL's trainers that generate or rebuild their batch in a micro-step (integrations/trl/generating.py).
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
    >>> from hf_gradaccum.integrations.registry import REGISTRY, register_composition
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
    >>> from hf_gradaccum.integrations.registry import composition_entry
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
        # routing refuses these rows on the first window, before any step (integrations/sentence_transformers/routing.py).
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
    >>> from hf_gradaccum.integrations.registry import unknown_composed_trainer
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
    >>> from hf_gradaccum.integrations.registry import composition_table
    >>> print(composition_table().splitlines()[0])
    | trainer | loss | accumulates by | what |
    ```
    """
    lines = ["| trainer | loss | accumulates by | what |", "|---|---|---|---|"]
    for (trainer, loss), entry in REGISTRY.items():
        what = entry.what + (f" Fix: {entry.fix}" if entry.fix else "")
        lines.append(f"| {trainer} | {loss} | {entry.how} | {what} |")
    return "\n".join(lines)


def refuse_under_deepspeed(trainer: Any) -> None:
    """Raise a [`CompositionError`], before any work, for a composed loss that DeepSpeed's engine path cannot weight:
    two terms with different counts, a loss sorted over the window, or items known only at the loss."""
    if (trainer._loss_terms or trainer._sorted_loss) is not None:
        what = (
            f"adds {trainer._loss_terms.term.term}, a mean over {trainer._loss_terms.term.items}, to a mean over "
            f"{trainer._loss_terms.term.primary}; the two terms need different micro-batch weights"
            if trainer._loss_terms is not None
            else f"sorts the batch ({trainer._sorted_loss.sorted_types}), which is answered from the window"
        )
        raise CompositionError(
            f"{type(trainer).__name__} under DeepSpeed: its loss {what}, set at the loss, which DeepSpeed's engine "
            "path does not reach. Stopped before any work. Fix: DDP or FSDP2, or `gradient_accumulation_steps=1`."
        )
    if not trainer._count_at_prefetch or trainer._handed_count:
        # DeepSpeed back-propagates a loss already weighted by its items: the count must exist before the loss.
        raise CompositionError(
            f"{type(trainer).__name__} under DeepSpeed: its parent classes rebuild the micro-batch before the loss "
            "(generation, slicing or collation) or divide by the count they are handed, so its items are known "
            "only at the loss, after the weight DeepSpeed's engine needs. Stopped before any work. Fix: DDP or "
            "FSDP2 (the accumulator counts at the loss there), or `gradient_accumulation_steps=1`."
        )


def attach_composed_losses(trainer: Any, gradaccum_cls: type) -> None:
    """
    Set on `trainer` (a `GradAccumTrainer`, whose class is `gradaccum_cls`) what its composed library trainer's loss
    needs beyond item weighting, each `None` where it does not apply: the refusals of the registry first (before any
    work), then where items are counted, the generating trainers' counting rule, the loss terms' weights, DPO's
    window sort, GRPO's window entropy quantile and KTO's window baseline.
    """
    # Compositions the registry refuses stop here; one it does not know is checked on its first window.
    refuse_unaccumulable_losses(trainer)
    trainer._unknown_composition = None
    if trainer.args.gradient_accumulation_steps > 1 and gradaccum_option(trainer.args, "check_unknown_compositions"):
        trainer._unknown_composition = unknown_composed_trainer(trainer)
    # Items are counted on the inputs that reach `compute_loss` (`losses/counting.py`); the count made at
    # prefetch time is reused only where the parents hand the loss that very batch.
    trainer._count_at_prefetch = hands_batch_to_loss_unchanged(trainer)
    # A loss that divides by the `num_items_in_batch` it is handed (GKD): the count of the batch handed over.
    trainer._handed_count = divides_by_handed_count(trainer)
    if trainer._unknown_composition and not trainer._count_at_prefetch:
        # The first-window check splits the prefetched batch; these parents rebuild it before their loss.
        raise refuse_rebuilt_micro_batches(trainer, trainer._unknown_composition)
    # TRL's online RL and distillation trainers (GRPO, RLOO, GMPO, Distillation) generate inside `_prepare_inputs`:
    # their loss is counted per loss type on the micro-batch it receives (`integrations/trl/grpo.py`).
    # A*-PO, SDPO and Online DPO build their batch in the micro-step too (`integrations/trl/generating.py`).
    trainer._generation_accumulation = generation_accumulation_for(trainer) or rebuilt_batch_accumulation_for(trainer)
    if getattr(trainer._generation_accumulation, "loss_inside_training_step", False):
        trainer._generation_accumulation.route_training_step(trainer, gradaccum_cls)
    # A loss of two terms with different denominators (TRL's NLL or entropy term beside a preference term): each
    # term weighted by its own count over the window (`integrations/trl/loss_terms.py`).
    trainer._loss_terms = window_term_weights_for(trainer)
    # DPO's `aot` losses sort the batch: sorted over the window (`integrations/trl/dpo_sorted.py`).
    trainer._sorted_loss = window_sorted_loss_for(trainer)
    # GRPO's `top_entropy_quantile < 1`: the window's quantile (`integrations/trl/grpo_entropy.py`).
    trainer._entropy_quantile = window_entropy_quantile_for(trainer)
    # TRL's KTOTrainer with a KL term: the window's baseline, shared by its micro-batches (`integrations/trl/kto.py`).
    trainer._kto_baseline = window_kl_baseline_for(trainer)


def unknown_composition_error(trainer: Any, finding: str) -> CompositionError:
    """The error that stops a trainer composed with a library trainer the registry does not know, when the
    split-invariance check on its first window (`finding`) did not show its loss exact."""
    loss = getattr(trainer.args, "loss_type", None) or getattr(trainer, "loss", None) or "its compute_loss"
    return CompositionError(
        f"GradAccumTrainer does not know how {trainer._unknown_composition} (loss: {loss!r}) accumulates, and the "
        "split-invariance check on the first window did not show it exact, so training may not equal the large "
        f"batch. Stopped before the first optimizer step.\n{finding}\nFix: `gradient_accumulation_steps=1` with the "
        "batch you want, or `register_composition` with how this loss accumulates "
        "(hf_gradaccum/integrations/registry.py); `check_unknown_compositions=False` trains without the check."
    )
