"""Losses made of several terms with different denominators, each weighted by its own count over the window.

TRL's preference trainers add an NLL (or entropy) term to a preference term: DPO with `"sft"` among its loss types
(RPO, MPO), CPO and SimPO with `cpo_alpha != 0`, ORPO (always), TPO with `tpo_alpha != 0`, and GRPO's entropy bonus
with a per-sequence loss. On one micro-batch the loss is

    L_k = P_k / p_k + w * T_k / t_k

(`P_k`: the preference term's sum over the micro-batch's `p_k` pairs, triples or sequences; `T_k`: the NLL or entropy
term's sum over its `t_k` tokens). The large batch's loss is `P / p + w * T / t` with the window's counts, so the two
terms need different micro-batch weights, `p_k / p` and `t_k / t`. The accumulator weights the whole micro-batch
loss by its items `c_k / c` (the primary count, the preference term's); for the length of the micro-batch's loss
the second term's weight is multiplied by

    f_k = (t_k / t) / (c_k / c)

through a lever the trainer itself reads (its `loss_weights` entry, `cpo_alpha`, `tpo_alpha`, `entropy_coef`, or the
NLL value its `concatenated_forward` returns), and put back afterwards. Summed over the window that is exactly the
large batch's loss; under several processes every count is the window's over all ranks, as the large batch's is.

The window's counts come from the prefetched micro-batches where the loss sees those very batches, and from the
buffered generation batch for GRPO and SDPO, which generate the whole window before its first loss.

| trainer | option | primary items | second term, its items | lever |
|---|---|---|---|---|
| DPOTrainer | `"sft"` in `loss_type` | pairs (rows) | the SFT term: chosen completion tokens | `loss_weights` |
| CPOTrainer | `cpo_alpha != 0` | pairs | the NLL term: chosen label tokens (shifted) | `cpo_alpha` |
| ORPOTrainer | (always) | pairs | the NLL term: chosen prompt and completion tokens (shifted) | `concatenated_forward` |
| TPOTrainer | `tpo_alpha != 0` | triples (rows) | the NLL term: reference completion tokens | `tpo_alpha` |
| GRPOTrainer | `entropy_coef != 0` | sequences (or tokens) | the entropy bonus: completion tokens (those above the window's entropy quantile) | `entropy_coef` |
| SDPOTrainer | `0 < distillation_weight < 1`, `bnpo`/`dapo` | sequences | the policy term: completion tokens | `_compute_policy_loss` |
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...losses.composed_class import nearest_trainer_named
from .generating import SDPO_POLICY_ITEMS
from .grpo import COMPLETION_TOKENS, LOSS_ITEMS, SEQUENCES

__all__ = ["LOSS_TERMS", "LossTerm", "WindowTermWeights", "window_term_weights_for"]

Restore = Callable[[], None]


def _chosen_completion_tokens(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    # DPO's SFT term: `-chosen_per_token_logps[chosen_mask.bool()].mean()` over `completion_mask[..., 1:]`, chosen
    # rows first.
    mask = inputs["completion_mask"]
    return mask[: mask.shape[0] // 2, 1:].sum()


def _reference_completion_tokens(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    # TPO lays the batch out as [chosen, rejected, reference]; its NLL is a token mean over the reference rows.
    mask = inputs["completion_mask"]
    rows = mask.shape[0] // 3
    return mask[2 * rows :, 1:].sum()


def _label_tokens(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    # `nn.CrossEntropyLoss()` ignores -100 only.
    return (labels[..., 1:] if shift else labels).ne(-100).sum()


def _cpo_chosen_tokens(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return _label_tokens(inputs["chosen_labels"], shift=not trainer.is_encoder_decoder)


def _orpo_chosen_tokens(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    # ORPO's NLL covers prompt and completion: its labels are the input ids where the attention mask is 1.
    if trainer.is_encoder_decoder:
        return _label_tokens(inputs["chosen_labels"], shift=False)
    return inputs["chosen_attention_mask"][..., 1:].sum()


def _completion_tokens(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    quantile = getattr(trainer, "_entropy_quantile", None)
    if quantile is not None:
        # With `top_entropy_quantile < 1` the bonus is a mean over the tokens above the window's threshold.
        return torch.tensor(quantile.kept_tokens(trainer, inputs))
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    return mask.sum()


@dataclass(frozen=True)
class _ScaleAttribute:
    """A lever for a term with a weight attribute of its own (`cpo_alpha`, `tpo_alpha`, `entropy_coef`): the
    attribute `name` is multiplied by the factor for one loss."""

    name: str

    def __call__(self, trainer: Any, factor: float) -> Restore:
        saved = getattr(trainer, self.name)
        setattr(trainer, self.name, saved * factor)
        return functools.partial(setattr, trainer, self.name, saved)


def _scale_dpo_sft_weight(trainer: Any, factor: float) -> Restore:
    saved = trainer.loss_weights
    trainer.loss_weights = [w * factor if t == "sft" else w for t, w in zip(trainer.loss_types, saved, strict=True)]
    return functools.partial(setattr, trainer, "loss_weights", saved)


@dataclass(frozen=True)
class _ScaledMethod:
    """`original` with the value it returns (its element `index`) multiplied by `factor`."""

    original: Callable[..., Any]
    factor: float
    index: int | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        if self.index is None:
            return out * self.factor
        return (*out[: self.index], out[self.index] * self.factor, *out[self.index + 1 :])


def _restore_method(trainer: Any, method: str, original: Callable[..., Any], had_own: bool) -> None:
    """Put back what `_ScaleOutput` shadowed: the instance's own attribute, or the class's method."""
    if had_own:
        setattr(trainer, method, original)
    else:
        delattr(trainer, method)


@dataclass(frozen=True)
class _ScaleOutput:
    """A lever for a term with no weight of its own: the value `method` returns (its element `index`) is scaled, by
    an instance attribute that shadows the method for one loss."""

    method: str
    index: int | None = None

    def __call__(self, trainer: Any, factor: float) -> Restore:
        had_own = self.method in vars(trainer)
        original = getattr(trainer, self.method)
        setattr(trainer, self.method, _ScaledMethod(original, factor, self.index))
        return functools.partial(_restore_method, trainer, self.method, original, had_own)


@dataclass(frozen=True)
class LossTerm:
    """
    The second term of a (trainer, option) loss: what it is a mean over and how its weight is changed for one loss.

    Args:
        trainer (`str`): the TRL trainer's class name.
        option (`str`): the loss option that adds the term (a `loss_type` entry or a config field).
        term (`str`): the term, in words.
        items (`str`): what the term is a mean over, in words.
        primary (`str`): what the rest of the loss is a mean over (the accumulator's items), in words.
        active (`Callable[[Any], bool]`): whether the trainer's configuration adds the term.
        count (`Callable[[Any, dict], torch.Tensor]`): the term's items in the inputs its loss sees.
        lever (`Callable[[Any, float], Callable[[], None]]`): multiplies the term's weight by a factor for one loss
            and returns what puts it back.

    Example:

    ```python
    >>> from hf_gradaccum.integrations.trl.loss_terms import LOSS_TERMS
    >>> [t.option for t in LOSS_TERMS if t.trainer == "DPOTrainer"]
    ['sft']
    ```
    """

    trainer: str
    option: str
    term: str
    items: str
    primary: str
    active: Callable[[Any], bool]
    count: Callable[[Any, dict[str, Any]], torch.Tensor]
    lever: Callable[[Any, float], Restore]


# Read from the arguments: in either class order they are set before this class's `__init__` code runs, the
# trainer's own attributes are not.
def _dpo_has_sft(trainer: Any) -> bool:
    loss_type = trainer.args.loss_type
    return "sft" in ([loss_type] if isinstance(loss_type, str) else list(loss_type or []))


def _nonzero(field: str) -> Callable[[Any], bool]:
    return lambda trainer: getattr(trainer.args, field, 0.0) != 0.0


def _sdpo_token_policy_beside_distillation(trainer: Any) -> bool:
    args = trainer.args
    policy = SDPO_POLICY_ITEMS.get(getattr(args, "loss_type", None))
    return 0.0 < getattr(args, "distillation_weight", 1.0) < 1.0 and policy == COMPLETION_TOKENS


def _entropy_bonus_with_its_own_count(trainer: Any) -> bool:
    # A token-mean policy loss ('bnpo', 'dapo', ...) shares the entropy bonus's denominator, nothing to reweigh,
    # unless the bonus is over the tokens above an entropy quantile only.
    args = trainer.args
    items = LOSS_ITEMS.get(("GRPOTrainer", getattr(args, "loss_type", None)))
    bonus = getattr(args, "entropy_coef", 0.0) != 0.0 or getattr(args, "use_adaptive_entropy", False)
    kept_only = getattr(args, "top_entropy_quantile", 1.0) < 1.0
    return bonus and items is not None and (items.items == SEQUENCES or kept_only)


LOSS_TERMS: tuple[LossTerm, ...] = (
    LossTerm(
        "DPOTrainer",
        "sft",
        "the SFT term",
        "chosen completion tokens",
        "pairs",
        _dpo_has_sft,
        _chosen_completion_tokens,
        _scale_dpo_sft_weight,
    ),
    LossTerm(
        "CPOTrainer",
        "cpo_alpha",
        "the NLL term (`cpo_alpha`)",
        "chosen completion tokens",
        "pairs",
        _nonzero("cpo_alpha"),
        _cpo_chosen_tokens,
        _ScaleAttribute("cpo_alpha"),
    ),
    LossTerm(
        "ORPOTrainer",
        "*",
        "the NLL term",
        "chosen prompt and completion tokens",
        "pairs",
        lambda t: True,
        _orpo_chosen_tokens,
        # ORPO's loss is `policy_nll_loss - losses.mean()`, no weight on the NLL: the value its forward returns is
        # scaled (its `nll_loss` metric then logs the micro-batch's weighted share).
        _ScaleOutput("concatenated_forward", index=4),
    ),
    LossTerm(
        "TPOTrainer",
        "tpo_alpha",
        "the NLL term (`tpo_alpha`)",
        "reference completion tokens",
        "triples",
        _nonzero("tpo_alpha"),
        _reference_completion_tokens,
        _ScaleAttribute("tpo_alpha"),
    ),
    LossTerm(
        "SDPOTrainer",
        "distillation_weight",
        "the policy term (`1 - distillation_weight`)",
        "completion tokens",
        "sequences",
        _sdpo_token_policy_beside_distillation,
        lambda trainer, inputs: inputs["completion_mask"].sum(),
        _ScaleOutput("_compute_policy_loss"),
    ),
    LossTerm(
        "GRPOTrainer",
        "entropy_coef",
        "the entropy bonus (`entropy_coef`)",
        "completion tokens",
        "sequences",
        _entropy_bonus_with_its_own_count,
        _completion_tokens,
        _ScaleAttribute("entropy_coef"),
    ),
)


class WindowTermWeights:
    """
    Per-term weights of one composed trainer's loss (see the module docstring): the window's counts, then, for each
    micro-batch's loss, the second term's weight multiplied by `f_k`. Built by [`window_term_weights_for`].

    Args:
        term ([`LossTerm`]): the second term of the trainer's loss.

    Example:

    ```python
    >>> weights = window_term_weights_for(trainer)  # doctest: +SKIP  (a GradAccumTrainer + DPOTrainer, "sft")
    >>> weights.start_window(trainer, batches, counts)  # doctest: +SKIP
    >>> restore = weights.scale(trainer, inputs, items)  # doctest: +SKIP
    ```
    """

    def __init__(self, term: LossTerm) -> None:
        self.term = term
        self.totals: tuple[float, float] | None = None

    def __repr__(self) -> str:
        return f"WindowTermWeights({self.term.trainer}, {self.term.term} over {self.term.items})"

    def start_window(self, trainer: Any, batches: Sequence[Any] | None, counts: Sequence[float] | None) -> None:
        """A new window: its counts from the prefetched `batches` and their items `counts`, when the loss sees those
        batches; otherwise (`None`) from the generation buffer at its first loss."""
        self.totals = None
        if batches is not None and counts is not None:
            terms = [self.term.count(trainer, batch) for batch in batches]
            self.totals = self._all_ranks(trainer, float(sum(counts)), terms)

    def _all_ranks(self, trainer: Any, items: float, terms: list[torch.Tensor]) -> tuple[float, float]:
        device = trainer.accelerator.device
        local = torch.stack(
            [torch.as_tensor(items, dtype=torch.float64, device=device)]
            + [torch.as_tensor(sum(t.double() for t in terms) if terms else 0.0, dtype=torch.float64, device=device)]
        )
        if trainer.accelerator.num_processes > 1:
            local = trainer.accelerator.reduce(local, reduction="sum")
        items_total, term_total = (float(v) for v in local.tolist())
        return items_total, term_total

    def _generation_totals(self, trainer: Any) -> tuple[float, float]:
        buffered = getattr(trainer, "_buffered_inputs", None)
        rule = trainer._generation_accumulation
        if not buffered or rule is None:
            raise RuntimeError(
                f"GradAccumTrainer expected {self.term.trainer}'s buffered generation batch before its first loss, "
                "to weigh each loss term by its own count; this TRL release changed how it buffers generations "
                "(tested with trl==1.16)."
            )
        items = float(sum(rule.count(batch) for batch in buffered))
        return self._all_ranks(trainer, items, [self.term.count(trainer, batch) for batch in buffered])

    def scale(self, trainer: Any, inputs: dict[str, Any], items: float) -> Restore:
        """Multiply the second term's weight for the loss on `inputs` (a micro-batch of `items` primary items) by
        `f_k`; returns what puts it back."""
        if self.totals is None:
            self.totals = self._generation_totals(trainer)
        items_total, term_total = self.totals
        term_items = float(self.term.count(trainer, inputs))
        if not items or not term_total or not term_items:
            # No tokens in this micro-batch's term: the stock loss of that term is not defined either; the weight is
            # left as it is.
            return lambda: None
        factor = (term_items / term_total) / (float(items) / items_total)
        return self.term.lever(trainer, factor)


def window_term_weights_for(trainer: Any) -> WindowTermWeights | None:
    """
    The [`WindowTermWeights`] of a trainer composed with one of the TRL trainers of [`LOSS_TERMS`] whose
    configuration adds the second term, with `gradient_accumulation_steps > 1`; `None` otherwise.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> window_term_weights_for(GradAccumTrainer.__new__(GradAccumTrainer)) is None
    True
    ```
    """
    name = nearest_trainer_named(trainer, {term.trainer for term in LOSS_TERMS})
    if name is None or getattr(getattr(trainer, "args", None), "gradient_accumulation_steps", 1) == 1:
        return None
    for term in LOSS_TERMS:
        if term.trainer == name and term.active(trainer):
            return WindowTermWeights(term)
    return None
