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
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..engine.items import count_items_in_batch
from ..engine.rng import capture_rng_state, generators_advanced_since
from .diagnosis import (
    Cause,
    Diagnosis,
    batch_coupled_layers,
    batchnorm_cause,
    denominator_cause,
    denominator_errors,
    discriminating_cut,
    moe_cause,
    nondeterminism_cause,
    not_a_mean_cause,
    stateful_cause,
    sum_cause,
    top_disagreements,
)
from .gradients import CountFn, ForwardFailed, LossFn, accumulated_gradient, model_loss, to_device
from .isolation import isolated_probe
from .windows import concat_window, cut, halve, merge_pairs, take_rows

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


EXACT, NOT_EXACT, CANNOT_DECIDE = "exact", "not_exact", "cannot_decide"
VERDICTS = (EXACT, NOT_EXACT, CANNOT_DECIDE)
# A split difference counts as "not exact" only if it is also this many times the run-to-run difference of one
# split computed twice (the noise floor of the forward), so that randomness never reads as a cause.
NOISE_MARGIN = 10.0


@dataclass
class SplitInvarianceResult:
    """
    The verdict of [`verify_split_invariance`].

    Attributes:
        verdict: `"exact"` (every split within `tolerance`), `"not_exact"` (a split differs beyond the tolerance and
            beyond the forward's own run-to-run noise; `diagnosis` says why) or `"cannot_decide"` (the forward is
            random or raised; `why` says what).
        passed: `verdict == "exact"`.
        max_rel_diff: the largest of `rel_diffs` (`nan` when nothing was compared).
        rel_diffs: split name -> ||g_split - g_window|| / ||g_window|| over all trainable parameters; `"repeat"` is
            the window computed a second time (run-to-run noise), measured when a split failed.
        tolerance, tolerance_rule: the threshold and why (dtype).
        splits: split name -> micro-batch sizes (rows); `"window"` is the reference.
        seconds: wall time of the check.
        notes: what the check did differently from what was asked (e.g. micro-batches of 1 row cannot be halved).
        diagnosis: where and why it is not exact (`None` when exact), or the random parts when it cannot decide.
        why: for `"cannot_decide"`, the reasons (a random forward, an exception and where it was raised).
        neutralised: the random parts switched off for the probe (dropout modules, config fields, attributes).
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
    verdict: str = ""
    why: list[str] = field(default_factory=list)
    neutralised: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = EXACT if self.passed else NOT_EXACT
        if self.verdict not in VERDICTS:
            raise ValueError(f"`verdict` must be one of {list(VERDICTS)}, got {self.verdict!r}.")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`max_rel_diff` is `None` when nothing was compared, since JSON has no NaN)."""
        out = asdict(self)
        if math.isnan(self.max_rel_diff):
            out["max_rel_diff"] = None
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        verdict = {EXACT: "EXACT", NOT_EXACT: "NOT EXACT", CANNOT_DECIDE: "CANNOT DECIDE"}[self.verdict]
        diffs = ", ".join(f"{name} {value:.2e}" for name, value in self.rel_diffs.items())
        measured = f"max relative difference {self.max_rel_diff:.2e}, " if self.rel_diffs else ""
        text = (
            f"split invariance: {verdict} ({measured}tolerance {self.tolerance:.0e}: {self.tolerance_rule})"
            f"{'; ' + diffs if diffs else ''}; {self.seconds:.2f} s"
        )
        for reason in self.why:
            text += f"\ncannot decide: {reason}"
        for note in self.notes:
            text += f"\nnote: {note}"
        if self.diagnosis is not None:
            text += "\n" + self.diagnosis.summary()
        return text


def _pad_token_id(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None) if config is not None else None
    return int(pad) if isinstance(pad, int) else 0


def _plan_splits(
    sizes: list[int], splits: Sequence[str], include_full_batch: bool, min_rows: int = 1
) -> tuple[dict, list[str]]:
    """The splits to compare with the window: each micro-batch halved when every half keeps `min_rows` rows (2 with
    BatchNorm), else pairs of micro-batches merged; `full` is the window as one batch."""
    notes: list[str] = []
    plan: dict[str, list[int]] = {"window": list(sizes)}
    wanted = list(dict.fromkeys([*splits, *(["full"] if include_full_batch else [])]))
    for name in wanted:
        if name not in SPLITS:
            raise ValueError(f"`splits` must contain only {list(SPLITS)}, got {name!r}.")
    for name in wanted:
        if name == "half":
            if min(sizes) >= 2 * min_rows:
                plan["half"] = halve(sizes)
                continue
            if len(sizes) < 2:
                continue
            why = (
                f"micro-batches of {min(sizes)} row(s) cannot be halved"
                if min_rows == 1
                else f"halves of micro-batches of {min(sizes)} rows would hold fewer than {min_rows} rows, which "
                "BatchNorm needs"
            )
            notes.append(
                f"{why}; compared with pairs of micro-batches merged instead ({len(sizes)} -> "
                f"{len(merge_pairs(sizes))} micro-batches)."
            )
            name = "merge"
        if name == "merge" and len(sizes) >= 2:
            plan["merge"] = merge_pairs(sizes)
        elif name == "full" and len(sizes) >= 2:
            plan["full"] = [sum(sizes)]
    return plan, notes


def _rel(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, list[float], list[float]]:
    """||a - b|| / ||b||, with the lists' squared differences and squared references. Against a zero reference `b`
    the difference is measured relative to `a`: 0 when `a` is zero too, 1 (all of it) when it is not, never the
    infinity that would make a deterministic forward look like noise."""
    diff_sq = [float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)]
    ref_sq = [float(y.pow(2).sum()) for y in b]
    den = sum(ref_sq) ** 0.5
    if den > 0:
        return sum(diff_sq) ** 0.5 / den, diff_sq, ref_sq
    other = sum(float(x.pow(2).sum()) for x in a) ** 0.5
    return (sum(diff_sq) ** 0.5 / other if other > 0 else 0.0), diff_sq, ref_sq


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

    Runs in training mode with every random part neutralised (dropout modules, stochastic depth, config switches
    such as `layerdrop` and `mask_time_prob`); BatchNorm keeps using batch statistics (that is what it must detect),
    and its micro-batches keep at least 2 rows (pairs merged instead of halves when rows are few). Weights, `.grad`,
    optimizer state, buffers (BatchNorm running statistics), the config, every RNG (torch CPU/CUDA, numpy, Python
    `random`) and any `GradientAccumulator`'s counters are left exactly as they were.

    The verdict is `"exact"`, `"not_exact"` (with the causes found) or `"cannot_decide"`: the window computed twice
    differs (randomness the probe could not switch off; the random parts are named), or the forward raised (what
    and where). A difference is called "not exact" only beyond the tolerance *and* beyond the forward's own noise.

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
        [`SplitInvarianceResult`]: `verdict`, `passed` (`verdict == "exact"`), `rel_diffs`, `diagnosis`, `why`.

    Raises:
        `TypeError`/`ValueError` for bad arguments (naming them) before any forward pass; never for an exception from
        the model's forward, which becomes a `"cannot_decide"` verdict.

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
    >>> result = verify_split_invariance(model, batches)
    >>> result.verdict, result.passed
    ('exact', True)
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
    coupled = batch_coupled_layers(model)
    plan, notes = _plan_splits(sizes, splits, include_full_batch, min_rows=2 if coupled else 1)
    if count_items is None:
        count_items = functools.partial(count_items_in_batch, shift_labels=shift_labels)
    loss_fn = loss_fn or model_loss
    names = [n for n, _ in named]
    params = [p for _, p in named]
    lowest = min({p.dtype for p in params} | ({dtype} if dtype else set()), key=lambda d: -torch.finfo(d).eps)
    tolerance = float(rtol) if rtol is not None else tolerance_for(lowest)
    rule = "given" if rtol is not None else f"{str(lowest).replace('torch.', '')} computation"

    def result(verdict: str, **kw: Any) -> SplitInvarianceResult:
        diffs = kw.pop("rel_diffs", {})
        compared = [v for k, v in diffs.items() if k != "repeat"]
        return SplitInvarianceResult(
            passed=verdict == EXACT,
            max_rel_diff=max(compared) if compared else float("nan"),
            rel_diffs=diffs,
            tolerance=tolerance,
            tolerance_rule=rule,
            splits=plan,
            seconds=time.perf_counter() - start,
            notes=notes,
            verdict=verdict,
            **kw,
        )

    if len(plan) == 1:
        if coupled:
            # Nothing to run: a BatchNorm in training mode normalises by the micro-batch, which settles it.
            notes.append(
                f"a window of {sizes} rows cannot be split into micro-batches of 2 rows or more (BatchNorm needs "
                "them); the verdict comes from inspecting the model, without a forward pass."
            )
            return result(NOT_EXACT, diagnosis=Diagnosis([], [], [batchnorm_cause(model)]))
        raise ValueError(
            f"`batches`: a window of {len(sizes)} micro-batch(es) of {sizes} rows cannot be split another way; pass "
            "at least 2 rows (2 micro-batches, or one micro-batch of 2 rows or more)."
        )

    rel_diffs: dict[str, float] = {}
    running = ["window"]  # the split being computed, for the message if the forward raises
    with isolated_probe(model) as trace:

        def gradient(split: str) -> list[torch.Tensor]:
            running[0] = split
            trace.reset_buffers()  # every split starts from the model's own state
            return accumulated_gradient(model, params, cut(rows, plan[split]), loss_fn, count_items)

        try:
            reference = gradient("window")
            ref_norm = sum(float(g.pow(2).sum()) for g in reference) ** 0.5
            worst: tuple[list[float], list[float]] | None = None
            split_grads = {split: gradient(split) for split in plan if split != "window"}
            if ref_norm == 0:
                # Every split of a zero gradient is zero too when accumulation is exact: nothing to scale by.
                nonzero = [split for split, grads in split_grads.items() if any(bool(g.any()) for g in grads)]
                if not nonzero:
                    notes.append("the gradient is zero on this window for every split: accumulation is exact.")
                    zero_diffs = dict.fromkeys(split_grads, 0.0)
                    return result(EXACT, rel_diffs=zero_diffs, neutralised=list(trace.neutralised))
            for split, grads in split_grads.items():
                rel_diffs[split], diff_sq, ref_sq = _rel(grads, reference)
                if rel_diffs[split] >= max(rel_diffs.values()):
                    worst = (diff_sq, ref_sq)
            max_rel = max(rel_diffs.values())
            if max_rel <= tolerance:
                return result(EXACT, rel_diffs=rel_diffs, neutralised=list(trace.neutralised))
            if rtol is None and dtype is None and lowest == torch.float32:
                exact64 = _float64_diffs(model, params, rows, plan, loss_fn, count_items, trace)
                # Every split must be measured and within the tolerance: `max` over a NaN depends on the order.
                if exact64 and all(math.isfinite(v) and v <= tolerance for v in exact64.values()):
                    notes.append(
                        f"the fp32 difference {max_rel:.2e} is rounding: the same splits computed in fp64 differ by "
                        f"{max(exact64.values()):.2e} ("
                        + ", ".join(f"{k} {v:.2e}" for k, v in exact64.items())
                        + "), within the tolerance."
                    )
                    return result(EXACT, rel_diffs=rel_diffs, neutralised=list(trace.neutralised))
                if exact64:
                    # The fp64 figures say the difference is not (only) rounding: keep them for the reader.
                    notes.append(
                        "the same splits computed in fp64 differ by "
                        + ", ".join(f"{k} {v:.2e}" for k, v in exact64.items())
                        + f" (fp32: {max_rel:.2e}): beyond the tolerance or not measured, so not fp32 rounding alone."
                    )
            # Before blaming the split: is the forward deterministic? The window once more, from the same state.
            rel_diffs["repeat"], noise_sq, ref_sq = _rel(gradient("window"), reference)
        except ForwardFailed as failure:
            split = running[0]
            why = (
                f"the forward/backward raised on the {split!r} split ({plan[split]} rows), micro-batch "
                f"{failure.index} ({failure.rows} row(s)): {failure}"
            )
            if coupled:
                notes.append(why)
                return result(NOT_EXACT, rel_diffs=rel_diffs, diagnosis=Diagnosis([], [], [batchnorm_cause(model)]))
            return result(CANNOT_DECIDE, rel_diffs=rel_diffs, why=[why], neutralised=list(trace.neutralised))
        noise = rel_diffs["repeat"]
        if noise > tolerance or max_rel <= NOISE_MARGIN * noise:
            sources = _random_sources(model, loss_fn, rows, plan["window"][0], params[0].device)
            top_params, top_modules = top_disagreements(names, noise_sq, ref_sq)
            cause = nondeterminism_cause(noise, sources, [m for m, _ in top_modules])
            why = [
                f"the window computed twice differs by {noise:.2e} (relative), comparable to the split difference "
                f"{max_rel:.2e}, so a split difference cannot be told from the forward's own variation. {cause.detail}"
            ]
            diagnosis = Diagnosis(top_params, top_modules, [cause])
            return result(CANNOT_DECIDE, rel_diffs=rel_diffs, why=why, diagnosis=diagnosis,
                          neutralised=list(trace.neutralised))  # fmt: skip
        diagnosis = None
        if diagnose:
            diagnosis = _diagnose(model, names, rows, plan, loss_fn, count_items, worst, tolerance, trace, coupled)
    if diagnosis is not None:
        extra = stateful_cause(trace.changed_buffers, model)
        if extra is not None:
            diagnosis.causes.append(extra)
    return result(NOT_EXACT, rel_diffs=rel_diffs, diagnosis=diagnosis, neutralised=list(trace.neutralised))


def _float64_diffs(model, params, rows, plan, loss_fn, count_items, trace) -> dict[str, float] | None:
    """The split differences of `plan` with the model, the rows and the gradients in fp64 (`None` if the forward
    cannot run in fp64: a kernel without fp64, a loss that mixes fp32 tensors of its own with the model's)."""
    from .float64 import in_float64, rows_in_float64

    rows64 = rows_in_float64(rows)

    def gradient(split: str) -> list[torch.Tensor]:
        trace.reset_buffers()
        cuts = cut(rows64, plan[split])
        return accumulated_gradient(model, params, cuts, loss_fn, count_items, grad_dtype=torch.float64)

    # New tensors in fp64 first (a loss that builds its targets with `torch.zeros` then matches the model's fp64);
    # else in fp32 (a loss that casts the model's output `.float()` and writes it into a tensor of its own).
    for default_dtype in (True, False):
        try:
            with in_float64(model, default_dtype=default_dtype):
                reference = gradient("window")
                return {split: _rel(gradient(split), reference)[0] for split in plan if split != "window"}
        except Exception:  # the fp32 verdict stands
            continue
        finally:
            trace.reset_buffers()
    return None


def _random_sources(model, loss_fn, rows, size, device) -> list[str]:
    """The random generators one forward draws from, with everything the probe neutralises switched off."""
    before = capture_rng_state()
    try:
        with torch.no_grad():
            loss_fn(model, to_device(take_rows(rows, 0, size), device))
    except Exception:  # the forward ran twice already; a failure here only means no source is named
        return []
    return generators_advanced_since(before)


def _probe_candidates(plan: dict[str, list[int]], min_rows: int) -> list[tuple[int, int]]:
    """Row ranges for the loss tests: each micro-batch of the window, and pairs merged when they are too small to
    cut in two parts of `min_rows` rows."""
    out, start = [], 0
    sizes = plan["window"]
    for size in sizes:
        out.append((start, start + size))
        start += size
    out = [(a, b) for a, b in out if b - a >= 2 * min_rows]
    if not out:
        bounds = list(itertools.accumulate([0, *sizes]))
        out = [(bounds[i], bounds[min(i + 2, len(sizes))]) for i in range(0, len(sizes), 2)]
        out = [(a, b) for a, b in out if b - a >= 2 * min_rows]
    return out


def _diagnose(model, names, rows, plan, loss_fn, count_items, worst, tolerance, trace, coupled) -> Diagnosis:
    """Causes supported by the evidence: layers found by inspection (BatchNorm, MoE router loss), then the loss
    tests on a batch and cut chosen so that competing counts predict different losses. "Not an item mean" is
    claimed only when no coupling layer explains the test's failure instead."""
    top_params, top_modules = top_disagreements(names, *worst)
    causes = [c for c in (batchnorm_cause(model), moe_cause(model)) if c is not None]
    device = next(model.parameters()).device
    candidates = _probe_candidates(plan, 2 if coupled else 1)
    try:
        if candidates:
            first = take_rows(rows, *candidates[0])
            trace.reset_buffers()
            summed = sum_cause(model, loss_fn, first, device)
            if summed is not None:
                causes.append(summed)
            else:
                chosen = discriminating_cut(rows, candidates, count_items, 2 if coupled else 1)
                errors = denominator_errors(model, loss_fn, count_items, rows, chosen, device, trace.reset_buffers)
                mismatch = denominator_cause(errors, tolerance)
                if mismatch is not None:
                    causes.append(mismatch)
                elif errors.get("count_items", 0.0) > max(tolerance, 1e-5):
                    trace.reset_buffers()
                    if not causes and stateful_cause(trace.changed_buffers, model) is None:
                        causes.append(not_a_mean_cause(errors))
    except Exception as error:  # a diagnostic forward on other shapes: report what was found so far
        causes.append(
            Cause(
                "diagnosis_incomplete",
                f"a diagnostic forward pass raised {type(error).__name__}: {error}; the loss tests were skipped.",
                "inspect the modules below.",
            )
        )
    return Diagnosis(top_parameters=top_params, top_modules=top_modules, causes=causes)
