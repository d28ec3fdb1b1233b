"""Parity report: does the accumulated run reproduce the large batch, and what did it cost in memory?

The recipes run several *arms* of one fine-tune (see `harness.arms`): the large batch itself (`reference`),
the same effective batch accumulated over micro-batches (`accumulated`), plain small batches (`small_batch`), and for
CNNs the BatchNorm variants. This module turns their results into

- `parity_report.json`: per arm the batch layout, optimizer steps, eval metrics, per-step train loss, max |loss
  difference| vs its reference, relative L2 distance of the final weights, peak memory, speed, and a verdict
  ([`validate_parity_report`] checks the schema);
- `parity_report.md`: a table and one verdict sentence per arm;
- `loss_curves.png` and `memory.png`.

Losses are compared step by step when the two arms take steps of the same number of samples (the exactness claim),
and at equal samples seen otherwise: the small-batch arm's losses are averaged in groups of `reference batch /
small batch` steps, so the curves line up on the samples they were computed on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2  # 2: first_step_loss_diff, noise_floor_loss_diff, within_noise_floor
ARM_STATUSES = ("ok", "oom", "failed")
LOSS_DIFF_BASES = ("per_step", "equal_samples")
REPORT_FILES = {
    "json": "parity_report.json",
    "markdown": "parity_report.md",
    "loss_curves": "loss_curves.png",
    "memory": "memory.png",
}

_NUMBER = (int, float)
_OPT_NUMBER = (int, float, type(None))
_OPT_STR = (str, type(None))

#: Top-level keys of the report and their allowed types (extra keys are allowed).
REPORT_SCHEMA: dict[str, tuple[type, ...]] = {
    "schema_version": (int,),
    "recipe": (str,),
    "created_at": (str,),
    "command": (str,),
    "model": (str,),
    "dataset": (str,),
    "train_samples": (int,),
    "eval_samples": (int,),
    "num_train_epochs": _NUMBER,
    "seed": (int,),
    "device": (str,),
    "memory_kind": _OPT_STR,
    "max_memory_mb": _OPT_NUMBER,
    "loss_tolerance": _NUMBER,
    "majority_class_accuracy": _OPT_NUMBER,
    "total_wall_time_s": _NUMBER,
    "arms": (list,),
}

#: Keys of each entry of `report["arms"]` and their allowed types (extra keys are allowed).
ARM_SCHEMA: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "kind": (str,),
    "status": (str,),
    "error": _OPT_STR,
    "batchnorm": (str,),
    "batchnorm_layers": (int,),
    "compared_to": _OPT_STR,
    "micro_batch_size": (int,),
    "gradient_accumulation_steps": (int,),
    "world_size": (int,),
    "effective_batch_size": (int,),
    "optimizer_steps": (int,),
    "epochs": _NUMBER,
    "train_loss": (list,),
    "eval_metrics": (dict,),
    "max_abs_loss_diff": _OPT_NUMBER,
    "loss_diff_basis": _OPT_STR,
    "weight_distance": _OPT_NUMBER,
    "matches_reference": (bool, type(None)),
    "first_step_loss_diff": _OPT_NUMBER,
    "noise_floor_loss_diff": _OPT_NUMBER,
    "within_noise_floor": (bool, type(None)),
    "peak_memory_mb": _OPT_NUMBER,
    "baseline_memory_mb": _OPT_NUMBER,
    "memory_kind": _OPT_STR,
    "fits_memory_limit": (bool, type(None)),
    "train_samples_per_second": _OPT_NUMBER,
    "train_runtime_s": _OPT_NUMBER,
    "wall_time_s": _OPT_NUMBER,
    "verdict": (str,),
}


#: How much larger than the noise floor's drift an arm's drift may be and still count as rounding (see
#: `_compare_with_noise_floor`): "the same order of magnitude".
NOISE_FLOOR_FACTOR = 10.0


# ---------------------------------------------------------------------------------------------------- comparisons
def loss_difference(
    losses: Sequence[float],
    reference_losses: Sequence[float],
    *,
    samples_per_step: int,
    reference_samples_per_step: int,
) -> tuple[float | None, str | None]:
    """
    Largest |loss difference| between an arm's per-step train losses and its reference's.

    Steps of the same size are compared one to one (`"per_step"`). When the reference's step is `k` times larger,
    the arm's losses are averaged in consecutive groups of `k` steps first (`"equal_samples"`): each group covers
    the samples of one reference step. Other ratios cannot be lined up and give `(None, None)`.

    Args:
        losses (`Sequence[float]`): the arm's per-optimizer-step train loss.
        reference_losses (`Sequence[float]`): the reference arm's.
        samples_per_step (`int`): the arm's effective batch size.
        reference_samples_per_step (`int`): the reference's effective batch size.

    Returns:
        `tuple`: the max |difference| (over the steps both arms have) and the basis, `"per_step"` or
        `"equal_samples"`.

    Example:

    ```python
    >>> from harness.reporting import loss_difference
    >>> diff, basis = loss_difference([0.9, 0.7], [0.9, 0.70002], samples_per_step=64, reference_samples_per_step=64)
    >>> round(diff, 8), basis
    (2e-05, 'per_step')
    >>> diff, basis = loss_difference([1.0, 0.8, 0.6, 0.6], [0.9, 0.5], samples_per_step=8, reference_samples_per_step=16)
    >>> round(diff, 8), basis
    (0.1, 'equal_samples')
    ```
    """
    if samples_per_step == reference_samples_per_step:
        aligned, basis = list(losses), "per_step"
    elif samples_per_step < reference_samples_per_step and reference_samples_per_step % samples_per_step == 0:
        aligned, basis = group_means(losses, reference_samples_per_step // samples_per_step), "equal_samples"
    else:
        return None, None
    n = min(len(aligned), len(reference_losses))
    if n == 0:
        return None, None
    return max(abs(a - b) for a, b in zip(aligned[:n], reference_losses[:n], strict=True)), basis


def group_means(values: Sequence[float], group: int) -> list[float]:
    """
    Means of consecutive groups of `group` values (a last incomplete group is dropped).

    Example:

    ```python
    >>> from harness.reporting import group_means
    >>> group_means([1.0, 3.0, 2.0, 4.0, 9.0], 2)
    [2.0, 3.0]
    ```
    """
    return [sum(values[i : i + group]) / group for i in range(0, len(values) - group + 1, group)]


def relative_weight_distance(weights: Mapping[str, Any], reference_weights: Mapping[str, Any]) -> float | None:
    """
    Relative L2 distance `||w - w_ref|| / ||w_ref||` over all parameters the two models share (same name and
    shape), accumulated in float64. `None` when they share none (different architectures).

    Args:
        weights (`Mapping[str, torch.Tensor]`): an arm's final parameters by name.
        reference_weights (`Mapping[str, torch.Tensor]`): its reference's.

    Returns:
        `float` or `None`.

    Example:

    ```python
    >>> import torch
    >>> from harness.reporting import relative_weight_distance
    >>> round(relative_weight_distance({"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([3.0, 4.5])}), 4)
    0.0925
    ```
    """
    diff_sq = ref_sq = 0.0
    shared = 0
    for name, ref in reference_weights.items():
        w = weights.get(name)
        if w is None or tuple(w.shape) != tuple(ref.shape):
            continue
        ref64, w64 = ref.double(), w.double()
        diff_sq += float((w64 - ref64).pow(2).sum())
        ref_sq += float(ref64.pow(2).sum())
        shared += 1
    if shared == 0:
        return None
    return math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)


def load_weights(path: str | Path) -> dict[str, Any]:
    """Load a `safetensors` file of parameters (written by `harness.arms.save_arm_weights`)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def primary_metric(eval_metrics: Mapping[str, float]) -> tuple[str | None, float | None]:
    """
    The headline eval metric: `eval_accuracy` when present, else the first `eval_*` that is not a loss or a timing.

    Example:

    ```python
    >>> from harness.reporting import primary_metric
    >>> primary_metric({"eval_loss": 0.5, "eval_accuracy": 0.8, "eval_runtime": 3.0})
    ('accuracy', 0.8)
    ```
    """
    if "eval_accuracy" in eval_metrics:
        return "accuracy", eval_metrics["eval_accuracy"]
    skip = ("loss", "runtime", "per_second", "epoch")
    for key, value in eval_metrics.items():
        if not any(s in key for s in skip):
            return key.removeprefix("eval_"), value
    return None, None


# ---------------------------------------------------------------------------------------------------- the report
def build_parity_report(
    arms: Sequence[Mapping[str, Any]],
    *,
    metadata: Mapping[str, Any],
    loss_tolerance: float = 1e-4,
    max_memory_mb: float | None = None,
    weight_paths: Mapping[str, str | Path] | None = None,
) -> dict[str, Any]:
    """
    Assemble the parity report from the arms' results: compare every arm with its reference (`compared_to`), decide
    whether it fits `max_memory_mb`, write one verdict per arm, and check the schema.

    Args:
        arms (`Sequence[Mapping]`): per-arm results as written by `harness.arms.collect_arm_result`.
        metadata (`Mapping`): run-level fields: `recipe`, `command`, `model`, `dataset`, `train_samples`,
            `eval_samples`, `num_train_epochs`, `seed`, `device`, `total_wall_time_s`, and optionally
            `majority_class_accuracy`.
        loss_tolerance (`float`, *optional*, defaults to 1e-4): largest per-step |Δloss| that counts as a match.
        max_memory_mb (`float`, *optional*): the emulated memory limit; arms whose peak exceeds it do not fit.
        weight_paths (`Mapping[str, path]`, *optional*): final weights per arm name, for the weight distance.

    Returns:
        `dict`: the report, valid for [`validate_parity_report`].

    Example:

    ```python
    >>> from harness.reporting import build_parity_report
    >>> base = dict(kind="reference", status="ok", error=None, batchnorm="keep", batchnorm_layers=0,
    ...             compared_to=None, world_size=1, epochs=1.0, eval_metrics={"eval_accuracy": 0.8},
    ...             baseline_memory_mb=500.0, memory_kind="cpu_peak_rss", train_samples_per_second=30.0,
    ...             train_runtime_s=10.0, wall_time_s=15.0)
    >>> arms = [
    ...     dict(base, name="reference", micro_batch_size=64, gradient_accumulation_steps=1, effective_batch_size=64,
    ...          optimizer_steps=2, train_loss=[0.7, 0.6], peak_memory_mb=2000.0),
    ...     dict(base, name="accumulated", kind="accumulated", compared_to="reference", micro_batch_size=8,
    ...          gradient_accumulation_steps=8, effective_batch_size=64, optimizer_steps=2,
    ...          train_loss=[0.7, 0.6000001], peak_memory_mb=900.0),
    ... ]
    >>> meta = dict(recipe="demo", command="python demo.py", model="m", dataset="d", train_samples=128,
    ...             eval_samples=32, num_train_epochs=1, seed=42, device="cpu", total_wall_time_s=30.0)
    >>> report = build_parity_report(arms, metadata=meta, max_memory_mb=1024)
    >>> report["arms"][1]["matches_reference"], report["arms"][0]["fits_memory_limit"]
    (True, False)
    ```
    """
    by_name = {arm["name"]: arm for arm in arms}
    weights_cache: dict[str, Any] = {}

    def weights_of(name: str) -> Any:
        if name not in weights_cache:
            path = None if weight_paths is None else weight_paths.get(name)
            weights_cache[name] = load_weights(path) if path is not None and Path(path).is_file() else None
        return weights_cache[name]

    report_arms = []
    for arm in arms:
        entry = dict(arm)
        entry.update(max_abs_loss_diff=None, loss_diff_basis=None, weight_distance=None, matches_reference=None)
        entry.update(first_step_loss_diff=None, noise_floor_loss_diff=None, within_noise_floor=None)
        reference = by_name.get(arm.get("compared_to") or "")
        if reference is not None and arm["status"] == "ok" and reference["status"] == "ok":
            diff, basis = loss_difference(
                arm["train_loss"],
                reference["train_loss"],
                samples_per_step=arm["effective_batch_size"],
                reference_samples_per_step=reference["effective_batch_size"],
            )
            entry.update(max_abs_loss_diff=diff, loss_diff_basis=basis)
            if basis == "per_step":
                entry["matches_reference"] = bool(
                    diff <= loss_tolerance and arm["optimizer_steps"] == reference["optimizer_steps"]
                )
                if arm["train_loss"] and reference["train_loss"]:
                    # Step 1 starts from the same weights: a difference here is the forward pass itself (BatchNorm
                    # over a micro-batch), not rounding amplified by training.
                    entry["first_step_loss_diff"] = abs(arm["train_loss"][0] - reference["train_loss"][0])
            elif basis is not None:
                entry["matches_reference"] = False  # a different optimisation by construction
            ours, theirs = weights_of(arm["name"]), weights_of(reference["name"])
            if ours is not None and theirs is not None:
                entry["weight_distance"] = relative_weight_distance(ours, theirs)
        if arm["status"] == "oom":
            entry["fits_memory_limit"] = False
        elif max_memory_mb is None or arm.get("peak_memory_mb") is None:
            entry["fits_memory_limit"] = None
        else:
            entry["fits_memory_limit"] = bool(arm["peak_memory_mb"] <= max_memory_mb)
        report_arms.append(entry)

    _compare_with_noise_floor(report_arms, loss_tolerance)
    report_by_name = {a["name"]: a for a in report_arms}
    for entry in report_arms:
        entry["verdict"] = arm_verdict(
            entry,
            report_by_name.get(entry.get("compared_to") or ""),
            loss_tolerance=loss_tolerance,
            max_memory_mb=max_memory_mb,
        )

    kinds = {a.get("memory_kind") for a in report_arms if a.get("memory_kind")}
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "majority_class_accuracy": None,
        **dict(metadata),
        "memory_kind": kinds.pop() if len(kinds) == 1 else None,
        "max_memory_mb": max_memory_mb,
        "loss_tolerance": loss_tolerance,
        "arms": report_arms,
    }
    validate_parity_report(report)
    return report


def _compare_with_noise_floor(report_arms: list[dict[str, Any]], loss_tolerance: float) -> None:
    """
    For every per-step-compared arm whose reference also has a finished `noise_floor` arm: record that arm's drift
    (`noise_floor_loss_diff`) and whether this arm's own drift is explained by it (`within_noise_floor`).

    Two conditions. Step 1 agrees within `loss_tolerance`: both runs start from the same weights, so a difference
    there is a different forward pass (BatchNorm over micro-batches), which no amount of rounding explains; this is
    the deterministic part of the test. And the largest per-step difference is of the same order of magnitude as the
    noise floor's (at most `NOISE_FLOOR_FACTOR` times it): once fp32 rounding has been amplified by ReLU/max-pool
    kinks, the drift saturates at a level set by the training dynamics, and its maximum over a run is one random draw
    that varies by a few times between perturbations. `matches_reference` stays the strict per-step test.
    """
    floors = {
        arm["compared_to"]: arm["max_abs_loss_diff"]
        for arm in report_arms
        if arm["kind"] == "noise_floor" and arm.get("max_abs_loss_diff") is not None
    }
    for arm in report_arms:
        floor = floors.get(arm.get("compared_to") or "")
        if arm["kind"] == "noise_floor" or floor is None or arm.get("loss_diff_basis") != "per_step":
            continue
        arm["noise_floor_loss_diff"] = floor
        arm["within_noise_floor"] = bool(
            arm["first_step_loss_diff"] is not None
            and arm["first_step_loss_diff"] <= loss_tolerance
            and arm["max_abs_loss_diff"] <= NOISE_FLOOR_FACTOR * floor
        )


def arm_verdict(
    arm: Mapping[str, Any],
    reference: Mapping[str, Any] | None,
    *,
    loss_tolerance: float = 1e-4,
    max_memory_mb: float | None = None,
) -> str:
    """
    One sentence on what an arm shows, e.g. `"accumulated: matches the large batch (max |Δloss| 3e-07, weights
    2e-06 rel.) at 45% of its peak memory; fits in 1,536 MiB."`.

    Example:

    ```python
    >>> from harness.reporting import arm_verdict
    >>> arm_verdict({"name": "small_batch", "status": "oom", "error": "CUDA out of memory"}, None,
    ...             max_memory_mb=1024)
    'small_batch: did not finish: out of memory under the 1,024 MiB limit.'
    ```
    """
    name = arm["name"]
    if arm["status"] == "oom":
        limit = f" under the {max_memory_mb:,.0f} MiB limit" if max_memory_mb is not None else ""
        return f"{name}: did not finish: out of memory{limit}."
    if arm["status"] != "ok":
        return f"{name}: did not finish ({arm['status']}: {arm.get('error')})."

    fit = _fit_clause(arm, max_memory_mb)
    metric_name, metric = primary_metric(arm.get("eval_metrics") or {})
    if reference is None or arm.get("loss_diff_basis") is None:
        if arm["kind"] == "reference":
            what = f"the large batch itself ({arm['effective_batch_size']} samples per step, no accumulation)"
        else:
            what = "not compared (no reference arm with the same model and normalisation was run)"
        score = f"; {metric_name} {metric:.3f}" if metric is not None else ""
        return f"{name}: {what}{score}; peak memory {_mb(arm.get('peak_memory_mb'))}{fit}."

    diff, weights = arm["max_abs_loss_diff"], arm.get("weight_distance")
    memory = _memory_clause(arm, reference)
    if arm["loss_diff_basis"] == "per_step":
        weight_text = f", weights {weights:.0e} rel." if weights is not None else ""
        if arm["kind"] == "noise_floor":
            return (
                f"{name}: the large batch again, every weight perturbed by 1e-7 relative (one fp32 rounding): it "
                f"drifts from {reference['name']} by up to {diff:.1e} per step{weight_text}; this is how far "
                "rounding alone moves this training run."
            )
        if arm.get("matches_reference"):
            return f"{name}: matches the large batch (max |Δloss| {diff:.0e}{weight_text}){memory}{fit}."
        why = ""
        if arm.get("batchnorm") in ("keep", "momentum") and arm.get("batchnorm_layers", 0) > 0:
            why = (
                f": as expected, its {arm['batchnorm_layers']} BatchNorm layers normalise over micro-batches of "
                f"{arm['micro_batch_size']}, not over the batch of {reference['effective_batch_size']}"
            )
        weight_text = f", weights {weights:.1e} rel." if weights is not None else ""
        if arm.get("within_noise_floor"):
            return (
                f"{name}: the large-batch computation up to fp32 rounding: step 1 agrees to "
                f"{arm['first_step_loss_diff']:.0e}, and the later drift (max |Δloss| {diff:.1e}{weight_text}) is of "
                f"the order of the large batch's own drift when its weights are perturbed by 1e-7 "
                f"({arm['noise_floor_loss_diff']:.1e}): rounding amplified by the training, not a different update"
                f"{memory}{fit}."
            )
        if not why and arm.get("noise_floor_loss_diff") is not None:
            first = arm["first_step_loss_diff"]
            why = (
                f": step 1 already differs ({first:.1e}), so the forward pass is not the large batch's"
                if first is not None and first > loss_tolerance
                else f": its drift is more than {NOISE_FLOOR_FACTOR:g}x the large batch's own drift under a 1e-7 "
                f"weight perturbation ({arm['noise_floor_loss_diff']:.1e})"
            )
        return (
            f"{name}: does NOT match the large batch (max |Δloss| {diff:.1e} > {loss_tolerance:.0e}"
            f"{weight_text}){why}{memory}{fit}."
        )
    ratio = reference["effective_batch_size"] // arm["effective_batch_size"]
    weight_text = f", weights {weights:.2g} rel." if weights is not None else ""
    _, ref_metric = primary_metric(reference.get("eval_metrics") or {})
    score = ""
    if metric is not None and ref_metric is not None:
        score = f"; {metric_name} {metric:.3f} vs {ref_metric:.3f}"
    return (
        f"{name}: a different optimisation ({ratio}x as many steps of {arm['effective_batch_size']} samples; "
        f"|Δloss| vs the large batch up to {diff:.2g} at equal samples seen{weight_text}){score}{memory}{fit}."
    )


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} MiB"


def _fit_clause(arm: Mapping[str, Any], max_memory_mb: float | None) -> str:
    if max_memory_mb is None or arm.get("fits_memory_limit") is None:
        return ""
    if arm["fits_memory_limit"]:
        return f"; fits in {max_memory_mb:,.0f} MiB"
    return f"; would NOT fit in {max_memory_mb:,.0f} MiB"


def _memory_clause(arm: Mapping[str, Any], reference: Mapping[str, Any]) -> str:
    ours, theirs = arm.get("peak_memory_mb"), reference.get("peak_memory_mb")
    if not ours or not theirs:
        return ""
    return f"; peak memory {_mb(ours)}, {ours / theirs:.0%} of the large batch's"


# ---------------------------------------------------------------------------------------------------- schema
def validate_parity_report(report: Mapping[str, Any]) -> None:
    """
    Check a parity report against [`REPORT_SCHEMA`] and [`ARM_SCHEMA`] plus its invariants (unique arm names,
    known statuses, `compared_to` naming a run arm, one train loss per optimizer step for finished arms).

    Raises:
        `ValueError`: listing every problem found.

    Example:

    ```python
    >>> from harness.reporting import validate_parity_report
    >>> validate_parity_report({"schema_version": 1})
    Traceback (most recent call last):
    ...
    ValueError: Invalid parity report: missing key 'recipe'; ...
    ```
    """
    problems: list[str] = []
    _check_fields(report, REPORT_SCHEMA, "", problems)
    arms = report.get("arms")
    if isinstance(arms, list):
        names = [a.get("name") for a in arms if isinstance(a, dict)]
        if len(set(names)) != len(names):
            problems.append(f"duplicate arm names in {names}")
        for i, arm in enumerate(arms):
            where = f"arms[{i}]"
            if not isinstance(arm, dict):
                problems.append(f"{where} is not an object")
                continue
            _check_fields(arm, ARM_SCHEMA, where + ".", problems)
            problems += _arm_invariants(arm, where, names)
    if problems:
        raise ValueError("Invalid parity report: " + "; ".join(problems))


def _check_fields(obj: Mapping[str, Any], schema: Mapping[str, tuple[type, ...]], where: str, out: list[str]) -> None:
    for key, types in schema.items():
        if key not in obj:
            out.append(f"missing key {where}{key!r}" if where else f"missing key {key!r}")
            continue
        value = obj[key]
        # bool is an int subclass: only accept it where bool is listed.
        if isinstance(value, bool) and bool not in types:
            out.append(f"{where}{key} is a bool, expected {_type_names(types)}")
        elif not isinstance(value, types):
            out.append(f"{where}{key} is {type(value).__name__}, expected {_type_names(types)}")


def _arm_invariants(arm: Mapping[str, Any], where: str, names: list[Any]) -> list[str]:
    problems = []
    if arm.get("status") not in ARM_STATUSES:
        problems.append(f"{where}.status {arm.get('status')!r} not in {list(ARM_STATUSES)}")
    if arm.get("loss_diff_basis") not in (None, *LOSS_DIFF_BASES):
        problems.append(f"{where}.loss_diff_basis {arm.get('loss_diff_basis')!r} not in {list(LOSS_DIFF_BASES)}")
    if arm.get("compared_to") is not None and arm.get("compared_to") not in names:
        problems.append(f"{where}.compared_to {arm.get('compared_to')!r} is not an arm of this report")
    losses = arm.get("train_loss")
    if isinstance(losses, list):
        if not all(isinstance(v, _NUMBER) and not isinstance(v, bool) for v in losses):
            problems.append(f"{where}.train_loss must hold numbers only")
        elif arm.get("status") == "ok" and len(losses) != arm.get("optimizer_steps"):
            problems.append(
                f"{where}.train_loss has {len(losses)} values for {arm.get('optimizer_steps')} optimizer steps"
            )
    metrics = arm.get("eval_metrics")
    if isinstance(metrics, dict) and not all(isinstance(v, _NUMBER) for v in metrics.values()):
        problems.append(f"{where}.eval_metrics must map names to numbers")
    return problems


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


# ---------------------------------------------------------------------------------------------------- rendering
def render_parity_markdown(report: Mapping[str, Any]) -> str:
    """
    The report as Markdown: run description, one table row per arm, one verdict per arm.

    Example:

    ```python
    >>> from harness.reporting import render_parity_markdown
    >>> text = render_parity_markdown(report)  # doctest: +SKIP
    >>> text.splitlines()[0]  # doctest: +SKIP
    '# Parity report: finetune_bert'
    ```
    """
    limit = report.get("max_memory_mb")
    memory_what = {"cpu_peak_rss": "peak RSS of the arm's process", "cuda_max_allocated": "CUDA max allocated"}
    lines = [
        f"# Parity report: {report['recipe']}",
        "",
        f"- model: `{report['model']}`; data: `{report['dataset']}` ({report['train_samples']:,} train / "
        f"{report['eval_samples']:,} eval samples, {report['num_train_epochs']:g} epoch(s), seed {report['seed']})",
        f"- device: {report['device']}; memory: {memory_what.get(report.get('memory_kind'), 'n/a')}"
        + (f"; emulated limit {limit:,.0f} MiB" if limit is not None else ""),
        f"- match tolerance: max per-step |Δloss| <= {report['loss_tolerance']:g}; total wall time "
        f"{report['total_wall_time_s']:.0f} s",
    ]
    if report.get("majority_class_accuracy") is not None:
        lines.append(f"- majority-class accuracy on the eval set: {report['majority_class_accuracy']:.3f}")
    lines += [
        f"- command: `{report['command']}`",
        "",
        "| arm | micro x steps = batch | BatchNorm | optimizer steps | eval metric | max \\|Δloss\\| vs | "
        "step-1 \\|Δloss\\| | weights rel. L2 | peak MiB | fits | samples/s | wall s |",
        "|---|---|---|---:|---:|---|---:|---:|---:|:---:|---:|---:|",
    ]
    for arm in report["arms"]:
        name, value = primary_metric(arm.get("eval_metrics") or {})
        metric = f"{name} {value:.3f}" if value is not None else "—"
        diff = "—"
        if arm.get("max_abs_loss_diff") is not None:
            basis = "" if arm["loss_diff_basis"] == "per_step" else " (equal samples)"
            diff = f"{arm['max_abs_loss_diff']:.1e} vs {arm['compared_to']}{basis}"
        fits = {True: "yes", False: "**no**", None: "—"}[arm.get("fits_memory_limit")]
        lines.append(
            f"| {arm['name']} | {arm['micro_batch_size']} x {arm['gradient_accumulation_steps']} = "
            f"{arm['effective_batch_size']} | {arm['batchnorm']} | {arm['optimizer_steps']} | {metric} | {diff} | "
            f"{_fmt(arm.get('first_step_loss_diff'), '.1e')} | "
            f"{_fmt(arm.get('weight_distance'), '.1e')} | {_fmt(arm.get('peak_memory_mb'), ',.0f')} | {fits} | "
            f"{_fmt(arm.get('train_samples_per_second'), '.1f')} | {_fmt(_arm_wall_time(arm), '.0f')} |"
        )
    lines += ["", "## Verdicts", ""]
    lines += [f"- {arm['verdict']}" for arm in report["arms"]]
    lines += ["", "![loss curves](loss_curves.png)", "", "![memory](memory.png)", ""]
    return "\n".join(lines)


def _arm_wall_time(arm: Mapping[str, Any]) -> float | None:
    """The arm's wall time as the console's per-arm line states it: its whole process (load, train, evaluate),
    falling back to the in-process time for reports written before that was recorded."""
    return arm.get("process_wall_time_s", arm.get("wall_time_s"))


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def format_summary(report: Mapping[str, Any]) -> str:
    """
    A one-screen plain-text summary (table and verdicts) to print at the end of a recipe.

    Example:

    ```python
    >>> from harness.reporting import format_summary
    >>> print(format_summary(report))  # doctest: +SKIP
    ```
    """
    header = f"{'arm':<24} {'batch':>13} {'steps':>6} {'metric':>8} {'max|Δloss|':>11} {'weights Δ':>10} "
    header += f"{'peak MiB':>9} {'fits':>5} {'samp/s':>7} {'wall s':>7}"
    rows = [
        f"Parity report: {report['recipe']} — {report['model']} on {report['dataset']} "
        f"({report['train_samples']:,} train / {report['eval_samples']:,} eval, {report['device']})",
        header,
        "-" * len(header),
    ]
    for arm in report["arms"]:
        _, value = primary_metric(arm.get("eval_metrics") or {})
        layout = f"{arm['micro_batch_size']}x{arm['gradient_accumulation_steps']}={arm['effective_batch_size']}"
        fits = {True: "yes", False: "NO", None: "-"}[arm.get("fits_memory_limit")]
        rows.append(
            f"{arm['name']:<24} {layout:>13} {arm['optimizer_steps']:>6} {_fmt(value, '.3f'):>8} "
            f"{_fmt(arm.get('max_abs_loss_diff'), '.1e'):>11} {_fmt(arm.get('weight_distance'), '.1e'):>10} "
            f"{_fmt(arm.get('peak_memory_mb'), ',.0f'):>9} {fits:>5} "
            f"{_fmt(arm.get('train_samples_per_second'), '.1f'):>7} {_fmt(_arm_wall_time(arm), '.0f'):>7}"
        )
    rows.append("")
    rows += [arm["verdict"] for arm in report["arms"]]
    rows.append(f"Total wall time: {report['total_wall_time_s']:.0f} s")
    return "\n".join(rows)


def plot_loss_curves(report: Mapping[str, Any], path: str | Path) -> Path:
    """
    Plot the train loss of every finished arm against samples seen (left) and the per-step |Δloss| of each arm vs
    its reference on a log scale (right), with the match tolerance. Small-batch arms are drawn raw (faint) and
    averaged over the reference's step (solid); both are in the legend. When the arms use several BatchNorm
    treatments (the ResNet recipe), the figure has one row per treatment (small multiples), each arm drawn with the
    reference it is compared to.

    Returns:
        `Path`: the PNG written.

    Example:

    ```python
    >>> from harness.reporting import plot_loss_curves
    >>> plot_loss_curves(report, "loss_curves.png")  # doctest: +SKIP
    ```
    """
    return _save(loss_curves_figure(report), path)


def loss_curves_figure(report: Mapping[str, Any]) -> Any:
    """The matplotlib figure that [`plot_loss_curves`] saves."""
    plt = _pyplot()
    by_name = {a["name"]: a for a in report["arms"]}
    finished = [a for a in report["arms"] if a["status"] == "ok" and a["train_loss"]]
    treatments = list(dict.fromkeys(a.get("batchnorm") or "keep" for a in finished)) or ["keep"]
    rows = len(treatments)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4.8 if rows == 1 else 3.4 * rows), squeeze=False)
    for (ax_loss, ax_diff), treatment in zip(axes, treatments, strict=True):
        arms = [a for a in finished if (a.get("batchnorm") or "keep") == treatment]
        # Each arm's reference is drawn with it, even when it belongs to another treatment (momentum vs keep).
        for arm in list(arms):
            reference = by_name.get(arm.get("compared_to") or "")
            if reference is not None and reference in finished and reference not in arms:
                arms.insert(0, reference)
        _draw_loss_panels(ax_loss, ax_diff, arms, by_name, report["loss_tolerance"])
        if rows > 1:
            ax_loss.set_title(f"BatchNorm: {treatment} - train loss per optimizer step", fontsize=9)
            ax_diff.set_title(f"BatchNorm: {treatment} - per-step |Δloss| vs reference", fontsize=9)
    fig.suptitle(f"{report['recipe']}: {report['model']} on {report['dataset']}", fontsize=10)
    fig.tight_layout()
    return fig


def _draw_loss_panels(
    ax_loss: Any, ax_diff: Any, arms: Sequence[Mapping[str, Any]], by_name, tolerance: float
) -> None:
    styles = ["-", "--", ":", "-."]
    for i, arm in enumerate(arms):
        batch = arm["effective_batch_size"]
        xs = [batch * (k + 1) for k in range(len(arm["train_loss"]))]
        reference = by_name.get(arm.get("compared_to") or "")
        style = dict(linestyle=styles[i % len(styles)], linewidth=1.6, label=f"{arm['name']} ({batch}/step)")
        if arm.get("loss_diff_basis") == "equal_samples" and reference is not None:
            group = reference["effective_batch_size"] // batch
            (line,) = ax_loss.plot(
                xs, arm["train_loss"], alpha=0.2, linewidth=0.8, label=f"{arm['name']}, each step (raw)"
            )
            means = group_means(arm["train_loss"], group)
            style["label"] = f"{arm['name']}, mean over {group} steps = {batch * group} samples"
            ax_loss.plot([batch * group * (k + 1) for k in range(len(means))], means, color=line.get_color(), **style)
        else:
            ax_loss.plot(xs, arm["train_loss"], **style)
        if arm.get("loss_diff_basis") == "per_step" and reference is not None:
            # Exact zeros (common: identical fp32 sums) cannot sit on a log axis; draw them at the floor.
            diffs = [max(abs(a - b), 1e-12) for a, b in zip(arm["train_loss"], reference["train_loss"], strict=False)]
            if arm["kind"] == "noise_floor":
                # A line, not points: the band that rounding alone spans, against which the points are read.
                look = dict(linestyle=":", linewidth=1.2, label=f"{arm['name']} vs {reference['name']} (rounding)")
            else:
                look = dict(marker="o", markersize=3, linestyle="none", label=f"{arm['name']} vs {reference['name']}")
            ax_diff.semilogy(range(1, len(diffs) + 1), diffs, **look)
    ax_loss.set_xlabel("samples seen")
    ax_loss.set_ylabel("train loss")
    ax_loss.set_title("Train loss per optimizer step")
    ax_loss.legend(fontsize=7)
    ax_loss.grid(alpha=0.3)
    ax_diff.axhline(tolerance, color="black", linestyle="--", linewidth=1, label="tolerance")
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel("|Δloss| vs reference (0 drawn at 1e-12)")
    ax_diff.set_title("Per-step loss difference, same batch per step")
    ax_diff.set_ylim(5e-13, max(1.0, 10 * tolerance))
    ax_diff.legend(fontsize=7, loc="best")
    ax_diff.grid(alpha=0.3, which="both")


def plot_memory(report: Mapping[str, Any], path: str | Path) -> Path:
    """
    Bar chart of each arm's peak memory (the part already in use before training is shaded), with the emulated
    limit as a line; arms that would not fit are red.

    Returns:
        `Path`: the PNG written.

    Example:

    ```python
    >>> from harness.reporting import plot_memory
    >>> plot_memory(report, "memory.png")  # doctest: +SKIP
    ```
    """
    plt = _pyplot()
    arms = report["arms"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(arms) + 2), 4.8))
    names = [a["name"] for a in arms]
    peaks = [a.get("peak_memory_mb") or 0.0 for a in arms]
    baselines = [min(a.get("baseline_memory_mb") or 0.0, p) for a, p in zip(arms, peaks, strict=True)]
    colors = ["tab:red" if a.get("fits_memory_limit") is False else "tab:blue" for a in arms]
    ax.bar(names, peaks, color=colors, alpha=0.85, label="peak during the arm")
    ax.bar(names, baselines, color="white", alpha=0.45, hatch="//", edgecolor="gray", label="in use before training")
    for x, (peak, arm) in enumerate(zip(peaks, arms, strict=True)):
        text = f"{peak:,.0f}" if arm["status"] != "oom" else "OOM"
        ax.annotate(text, (x, peak), ha="center", va="bottom", fontsize=8)
    if report.get("max_memory_mb") is not None:
        ax.axhline(report["max_memory_mb"], color="black", linestyle="--", linewidth=1.2, label="emulated limit")
    unit = {"cpu_peak_rss": "peak RSS (MiB)", "cuda_max_allocated": "CUDA max allocated (MiB)"}
    ax.set_ylabel(unit.get(report.get("memory_kind"), "peak memory (MiB)"))
    ax.set_title(f"{report['recipe']}: peak memory per arm")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, path)


def write_parity_report(report: Mapping[str, Any], output_dir: str | Path) -> dict[str, Path]:
    """
    Validate `report` and write `parity_report.json`, `parity_report.md`, `loss_curves.png` and `memory.png` into
    `output_dir`.

    Returns:
        `dict[str, Path]`: the files written, by kind (`json`, `markdown`, `loss_curves`, `memory`).

    Example:

    ```python
    >>> from harness.reporting import write_parity_report
    >>> paths = write_parity_report(report, "outputs/bert")  # doctest: +SKIP
    >>> sorted(paths)  # doctest: +SKIP
    ['json', 'loss_curves', 'markdown', 'memory']
    ```
    """
    validate_parity_report(report)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: output_dir / name for kind, name in REPORT_FILES.items()}
    # NaN stays NaN (a diverged arm) rather than failing the whole report.
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(render_parity_markdown(report))
    plot_loss_curves(report, paths["loss_curves"])
    plot_memory(report, paths["memory"])
    return paths


def load_parity_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a `parity_report.json`."""
    report = json.loads(Path(path).read_text())
    validate_parity_report(report)
    return report


def _pyplot():
    import matplotlib

    # Headless: the recipes run on servers and in CI.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


if __name__ == "__main__":
    # Re-render a report's Markdown and plots from its JSON (no training):
    #   PYTHONPATH=recipes python -m harness.reporting docs/resnet/parity_report.json
    import sys

    for json_path in sys.argv[1:]:
        written = write_parity_report(load_parity_report(json_path), Path(json_path).parent)
        print(" ".join(str(p) for p in written.values()))
