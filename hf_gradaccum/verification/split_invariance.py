"""`verify_split_invariance`: is accumulation exact for *this* model, loss and item counting? Proved without the
large batch.

For a loss that is a mean over independent items, the item-weighted accumulated gradient of a window does not depend
on how the window is split into micro-batches. The check recomputes the same samples' gradient for N micro-batches of
b (the window as given) and for 2N of b/2 (and one batch of N*b when asked), and compares.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.items import count_items_in_batch
from .diagnosis import (
    Diagnosis,
    batchnorm_cause,
    denominator_cause,
    moe_cause,
    nondeterminism_cause,
    not_a_mean_cause,
    stateful_cause,
    sum_cause,
    top_disagreements,
)
from .gradients import CountFn, LossFn, accumulated_gradient, model_loss
from .isolation import isolated_probe
from .windows import concat_window, cut, halve, merge_pairs

FP32_TOLERANCE = 1e-5
SPLITS = ("half", "merge", "full")


def tolerance_for(dtype: torch.dtype) -> float:
    """
    Relative tolerance on the gradient for computations in `dtype`: 1e-5 in fp32/fp64, else 4 x the dtype's machine
    epsilon (bf16 3.1e-2, fp16 3.9e-3): the rounding floor of one forward/backward in that precision, far below the
    deviations the check exists to catch (BatchNorm: ~0.1-1).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.verification import tolerance_for
    >>> tolerance_for(torch.float32), tolerance_for(torch.bfloat16)
    (1e-05, 0.03125)
    ```
    """
    if dtype in (torch.float32, torch.float64):
        return FP32_TOLERANCE
    return max(FP32_TOLERANCE, 4 * torch.finfo(dtype).eps)


@dataclass
class SplitInvarianceResult:
    """
    The verdict of [`verify_split_invariance`].

    Attributes:
        passed: every split's relative difference is within `tolerance`.
        max_rel_diff: the largest of `rel_diffs`.
        rel_diffs: split name -> ||g_split - g_window|| / ||g_window|| over all trainable parameters.
        tolerance, tolerance_rule: the threshold and why (dtype).
        splits: split name -> micro-batch sizes (rows); `"window"` is the reference.
        seconds: wall time of the check.
        notes: what the check did differently from what was asked (e.g. micro-batches of 1 row cannot be halved).
        diagnosis: where and why it failed (`None` when it passed).
    """

    passed: bool
    max_rel_diff: float
    rel_diffs: dict[str, float]
    tolerance: float
    tolerance_rule: str
    splits: dict[str, list[int]]
    seconds: float
    notes: list[str] = field(default_factory=list)
    diagnosis: Diagnosis | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        verdict = "EXACT" if self.passed else "NOT EXACT"
        diffs = ", ".join(f"{name} {value:.2e}" for name, value in self.rel_diffs.items())
        text = (
            f"split invariance: {verdict} (max relative difference {self.max_rel_diff:.2e}, tolerance "
            f"{self.tolerance:.0e}: {self.tolerance_rule}); {diffs}; {self.seconds:.2f} s"
        )
        for note in self.notes:
            text += f"\nnote: {note}"
        if self.diagnosis is not None:
            text += "\n" + self.diagnosis.summary()
        return text


def _pad_token_id(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None) if config is not None else None
    return int(pad) if isinstance(pad, int) else 0


def _plan_splits(sizes: list[int], splits: Sequence[str], include_full_batch: bool) -> tuple[dict, list[str]]:
    notes: list[str] = []
    plan: dict[str, list[int]] = {"window": list(sizes)}
    wanted = list(dict.fromkeys([*splits, *(["full"] if include_full_batch else [])]))
    for name in wanted:
        if name not in SPLITS:
            raise ValueError(f"`splits` must contain only {list(SPLITS)}, got {name!r}.")
        if name == "half":
            if min(sizes) >= 2:
                plan["half"] = halve(sizes)
                continue
            if len(sizes) < 2:
                continue
            notes.append(
                f"micro-batches of {min(sizes)} row cannot be halved; compared with pairs of micro-batches merged "
                f"instead ({len(sizes)} -> {len(merge_pairs(sizes))} micro-batches)."
            )
            name = "merge"
        if name == "merge" and len(sizes) >= 2:
            plan["merge"] = merge_pairs(sizes)
        elif name == "full" and len(sizes) >= 2:
            plan["full"] = [sum(sizes)]
    if len(plan) == 1:
        raise ValueError(
            f"`batches`: a window of {len(sizes)} micro-batch(es) of {sizes} rows cannot be split another way; pass "
            "at least 2 rows (2 micro-batches, or one micro-batch of 2 rows or more)."
        )
    return plan, notes


def verify_split_invariance(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    loss_fn: LossFn | None = None,
    count_items: CountFn | None = None,
    shift_labels: bool = False,
    splits: Sequence[str] = ("half",),
    include_full_batch: bool = False,
    rtol: float | None = None,
    dtype: torch.dtype | None = None,
    num_batches: int | None = None,
    diagnose: bool = True,
) -> SplitInvarianceResult:
    """
    Check that exact gradient accumulation holds for `model` on one real window: the item-weighted accumulated
    gradient of the window's samples is the same for N micro-batches of b (as given), for 2N of b/2 (`"half"`; with
    micro-batches of one row, N/2 of 2b: `"merge"`) and, with `include_full_batch`, for one batch (`"full"`).

    Runs in training mode with dropout and other stochastic layers neutralised; BatchNorm keeps using batch
    statistics (that is what it must detect). Weights, `.grad`, optimizer state, buffers (BatchNorm running
    statistics), RNG states and any `GradientAccumulator`'s counters are left exactly as they were.

    Args:
        model (`nn.Module`): the model as it trains (wrappers are fine).
        batches (iterable of `dict[str, Tensor]`): the micro-batches of one window (a list, or a dataloader with
            `num_batches`). Token tensors of different lengths are right-padded (labels -100, masks 0).
        loss_fn (`Callable[[model, batch], Tensor]`, *optional*): the micro-batch's loss as training computes it;
            defaults to `model(**batch).loss`.
        count_items (`Callable[[batch], float]`, *optional*): the item count that weights each micro-batch; defaults
            to the non-(-100) labels (`labels[..., 1:]` with `shift_labels=True`).
        shift_labels (`bool`): count a causal LM's shifted labels in the default `count_items`.
        splits (`Sequence[str]`): among `"half"`, `"merge"`, `"full"`.
        include_full_batch (`bool`): also compare the one-batch gradient (needs the memory of the whole window).
        rtol (`float`, *optional*): tolerance; defaults to [`tolerance_for`] the lowest-precision dtype in use.
        dtype (`torch.dtype`, *optional*): the autocast dtype of training, if any (sets the default tolerance).
        num_batches (`int`, *optional*): take only the first `num_batches` micro-batches of `batches`.
        diagnose (`bool`): on failure, look for the causes (a few extra forward passes).

    Returns:
        [`SplitInvarianceResult`].

    Example:

    ```python
    >>> import torch
    >>> from transformers import BertConfig, BertForSequenceClassification
    >>> from hf_gradaccum import verify_split_invariance
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    ...     intermediate_size=16, vocab_size=50))
    >>> batches = [{"input_ids": torch.randint(1, 50, (4, 6)), "labels": torch.randint(0, 2, (4,))} for _ in range(2)]
    >>> verify_split_invariance(model, batches).passed
    True
    ```
    """
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("`model` has no trainable parameters (requires_grad=True): there is no gradient to check.")
    if num_batches is not None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"`num_batches` must be an integer >= 1, got {num_batches!r}.")
        batches = list(itertools.islice(batches, num_batches))
    batches = list(batches)
    if rtol is not None and not (isinstance(rtol, (int, float)) and rtol > 0):
        raise ValueError(f"`rtol` must be a positive number, got {rtol!r}.")
    rows, sizes = concat_window(batches, pad_token_id=_pad_token_id(model))
    plan, notes = _plan_splits(sizes, splits, include_full_batch)
    if count_items is None:
        count_items = functools.partial(count_items_in_batch, shift_labels=shift_labels)
    loss_fn = loss_fn or model_loss
    names = [n for n, _ in named]
    params = [p for _, p in named]
    lowest = min({p.dtype for p in params} | ({dtype} if dtype else set()), key=lambda d: -torch.finfo(d).eps)
    tolerance = float(rtol) if rtol is not None else tolerance_for(lowest)
    rule = "given" if rtol is not None else f"{str(lowest).replace('torch.', '')} computation"

    rel_diffs: dict[str, float] = {}
    worst: tuple[list[float], list[float]] | None = None
    with isolated_probe(model) as trace:
        reference = accumulated_gradient(model, params, cut(rows, plan["window"]), loss_fn, count_items)
        ref_sq = [float(g.pow(2).sum()) for g in reference]
        ref_norm = sum(ref_sq) ** 0.5
        if ref_norm == 0:
            raise ValueError("`model`'s gradient is zero on this window (no items reach a trainable parameter).")
        for name, split_sizes in plan.items():
            if name == "window":
                continue
            grads = accumulated_gradient(model, params, cut(rows, split_sizes), loss_fn, count_items)
            diff_sq = [float((g - r).pow(2).sum()) for g, r in zip(grads, reference, strict=True)]
            rel_diffs[name] = sum(diff_sq) ** 0.5 / ref_norm
            if worst is None or rel_diffs[name] >= max(rel_diffs.values()):
                worst = (diff_sq, ref_sq)
            del grads
        max_rel = max(rel_diffs.values())
        passed = max_rel <= tolerance
        diagnosis = None
        if not passed and diagnose:
            diagnosis = _diagnose(model, params, names, rows, plan, loss_fn, count_items, reference, worst, tolerance)
    if diagnosis is not None:
        extra = stateful_cause(trace.changed_buffers, model)
        if extra is not None:
            # A stateful layer explains a loss that no count reproduces better than "not an item mean" does.
            diagnosis.causes = [c for c in diagnosis.causes if c.kind != "loss_not_an_item_mean"] + [extra]
    return SplitInvarianceResult(
        passed=passed,
        max_rel_diff=max_rel,
        rel_diffs=rel_diffs,
        tolerance=tolerance,
        tolerance_rule=rule,
        splits=plan,
        seconds=time.perf_counter() - start,
        notes=notes,
        diagnosis=diagnosis,
    )


def _diagnose(model, params, names, rows, plan, loss_fn, count_items, reference, worst, tolerance) -> Diagnosis:
    top_params, top_modules = top_disagreements(names, *worst)
    causes = [c for c in (batchnorm_cause(model), moe_cause(model)) if c is not None]
    device = params[0].device
    # The probe batch for the loss tests: the first micro-batch (two of them merged if it has one row).
    first = cut(rows, [plan["window"][0] if plan["window"][0] >= 2 else sum(plan["window"][:2])])[0]
    summed = sum_cause(model, loss_fn, first, device)
    if summed is not None:
        causes.append(summed)
    else:
        mismatch = denominator_cause(model, loss_fn, count_items, first, device, tolerance)
        if mismatch is not None:
            causes.append(mismatch)
    if not causes:
        again = accumulated_gradient(model, params, cut(rows, plan["window"]), loss_fn, count_items)
        num = sum(float((a - r).pow(2).sum()) for a, r in zip(again, reference, strict=True)) ** 0.5
        den = sum(float(r.pow(2).sum()) for r in reference) ** 0.5
        if num / den > tolerance / 10:
            causes.append(nondeterminism_cause(num / den))
        else:
            causes.append(not_a_mean_cause())
    return Diagnosis(top_parameters=top_params, top_modules=top_modules, causes=causes)
