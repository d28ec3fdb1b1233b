"""Why a split changed the gradient: the known causes, each detected on the model and the data, with its fix.

Each cause is detected by what it *does*, not only by what the model is called:
- BatchNorm-family layers in training mode (normalise by the micro-batch's statistics): found by type.
- A mixture-of-experts router loss (load balancing over the micro-batch's tokens): `config.output_router_logits`
  with a non-zero `router_aux_loss_coef`.
- A loss that is a sum: the loss of a micro-batch concatenated with itself is twice its loss (a mean's is equal).
- Item counts that disagree with the loss's own denominator: the loss of a batch is compared with the
  count-weighted mean of the losses of its two parts, for each way of counting (`count_items`, non-(-100) labels,
  `labels[..., 1:]`, rows); the one that reproduces it is what the loss divides by. The batch and the cut are chosen
  so that the counts predict *different* losses (parts with different token counts per row), so the answer does not
  depend on a lucky split. A loss that matches rows is a per-row (per-sequence) loss averaged over rows.
- Stateful layers: buffers other than BatchNorm's that the forward passes changed (spectral norm, EMA layers).
- A forward that is not deterministic: the reference split run twice gives two gradients (the verdict is then
  "cannot decide", see `split_invariance`).

Every kind and its fix is in `FIXES`, so that a new cause is one entry there and one detector here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.items import count_items as count_label_items
from .gradients import CountFn, LossFn, batch_rows, to_device
from .windows import take_rows

NORMALIZATION_FIX = (
    "replace them with GroupNorm (`hf_gradaccum.helpers.normalization.convert_batchnorm_to_groupnorm(model)`, exact) "
    "or freeze them (`freeze_batchnorm(model)`: fixed running statistics, exact), or accept that the gradient "
    "differs from the large batch's (`batchnorm_momentum_correction=True` then at least keeps the running "
    "statistics' decay per optimizer step)."
)


ROWS = "rows"
ROW_WEIGHTING_FIX = (
    "weight micro-batches by rows, not tokens: count one item per row (`count_items=lambda batch: "
    "batch['labels'].shape[0]`; in GradAccumTrainer override `count_micro_batch_items` to return the micro-batch's "
    "rows; in a plain loop pass `accumulator.backward(loss, num_items=rows)`)."
)

# kind -> the fix suggested. One entry per cause; the detectors below build `Cause`s from it.
FIXES: dict[str, str] = {
    "batchnorm": NORMALIZATION_FIX,
    "moe_router_aux_loss": (
        "set `config.output_router_logits=False` (no auxiliary loss: the LM loss accumulates exactly), or accept a "
        "deviation of the order of `router_aux_loss_coef` in the router gradients."
    ),
    "sum_loss": (
        "return a mean over items from the loss (`reduction='mean'`, or divide the sum by the number of items), or "
        "divide it by the micro-batch's item count in `compute_loss`."
    ),
    "item_count_mismatch": (
        "count what the loss divides by ({count}): in GradAccumTrainer override `count_micro_batch_items` (or set "
        "`count_shifted_labels` for a causal LM the trainer cannot recognise); in a plain loop pass that count to "
        "`accumulator.backward(loss, num_items=...)`."
    ),
    "row_mean_loss": ROW_WEIGHTING_FIX,
    "stateful_layers": "put those layers in eval mode during training, or update their state once per optimizer step.",
    "loss_not_an_item_mean": (
        "use a loss that is a mean over independent items, or accept that accumulation approximates the large batch. "
        "In-batch negatives (contrastive, ranking): use the coupled-loss mode (`hf_gradaccum.CoupledLoss`), exact."
    ),
    "nondeterministic_forward": (
        "make the forward deterministic for the check (switch off the random layer or seed it from the inputs), "
        "or set `torch.use_deterministic_algorithms(True)` for nondeterministic kernels."
    ),
}


@dataclass
class Cause:
    """One detected reason why accumulation is not exact for this model, with the fix."""

    kind: str
    detail: str
    fix: str
    modules: list[str] = field(default_factory=list)


@dataclass
class Diagnosis:
    """Where the splits disagree (top parameters and modules, by norm of the difference) and the causes found."""

    top_parameters: list[tuple[str, float]]
    top_modules: list[tuple[str, float]]
    causes: list[Cause]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = []
        for cause in self.causes:
            lines.append(f"- {cause.kind}: {cause.detail}\n  fix: {cause.fix}")
        if not self.causes:
            lines.append("- no known cause detected; inspect the modules below.")
        top = ", ".join(f"{name} ({value:.2g})" for name, value in self.top_modules[:5])
        lines.append(f"- disagreeing most (relative difference of their gradient): {top}")
        return "\n".join(lines)


def top_disagreements(
    names: Sequence[str], diff_sq: Sequence[float], ref_sq: Sequence[float], k: int = 5
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Parameters and modules (parameter name minus its last part) ranked by the norm of their gradient difference,
    each with its relative difference ||diff|| / ||reference||."""
    modules: dict[str, list[float]] = {}
    for name, d, r in zip(names, diff_sq, ref_sq, strict=True):
        entry = modules.setdefault(name.rsplit(".", 1)[0] if "." in name else name, [0.0, 0.0])
        entry[0] += d
        entry[1] += r

    def ranked(items):
        order = sorted(items, key=lambda item: item[1], reverse=True)[:k]
        return [(n, (d**0.5) / (r**0.5) if r > 0 else float("inf")) for n, d, r in order if d > 0]

    params = ranked(list(zip(names, diff_sq, ref_sq, strict=True)))
    mods = ranked([(n, d, r) for n, (d, r) in modules.items()])
    return params, mods


def batchnorm_cause(model: nn.Module) -> Cause | None:
    names = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not names:
        return None
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return Cause(
        "batchnorm",
        f"{len(names)} BatchNorm layer(s) normalise each micro-batch by its own statistics, so the gradient depends "
        f"on how the window is split: {shown}.",
        FIXES["batchnorm"],
        names,
    )


def batch_coupled_layers(model: nn.Module) -> list[str]:
    """Layers that compute each row from the statistics of the whole micro-batch (every BatchNorm*d, SyncBatchNorm:
    `_BatchNorm` subclasses), found by inspection. A frozen BatchNorm (not a `_BatchNorm`) is per-row."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _configs(model: nn.Module) -> list[Any]:
    seen, out = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "to_dict"):
            seen.add(id(config))
            out.append(config)
    return out


def moe_cause(model: nn.Module) -> Cause | None:
    for config in _configs(model):
        coef = getattr(config, "router_aux_loss_coef", None) or getattr(config, "aux_loss_coef", None)
        if getattr(config, "output_router_logits", False) and coef:
            routers = [
                name for name, m in model.named_modules() if "moe" in type(m).__name__.lower() or name.endswith("gate")
            ]
            return Cause(
                "moe_router_aux_loss",
                f"the mixture-of-experts load-balancing loss (router_aux_loss_coef={coef}) is computed over each "
                "micro-batch's tokens together, not as a mean over independent items, so it changes with the split.",
                FIXES["moe_router_aux_loss"],
                routers[:16],
            )
    return None


def sum_cause(model: nn.Module, loss_fn: LossFn, batch: dict[str, Any], device: torch.device) -> Cause | None:
    """A mean over items is the same for a batch and for the batch twice; a sum doubles."""
    doubled = {k: (torch.cat([v, v]) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
    with torch.no_grad():
        single = float(loss_fn(model, to_device(batch, device)))
        twice = float(loss_fn(model, to_device(doubled, device)))
    if single == 0 or not abs(twice / single - 2.0) < 1e-3:
        return None
    return Cause(
        "sum_loss",
        f"the loss is a sum, not a mean: a micro-batch gives {single:.6g}, the same micro-batch twice gives "
        f"{twice:.6g} (x{twice / single:.4f}). Weighting micro-batches by their item counts then counts every item "
        "N-fold.",
        FIXES["sum_loss"],
    )


def _counters(count_items: CountFn, labels: Any) -> dict[str, CountFn]:
    """The ways of counting items a loss may divide by; `count_items` first."""
    counters: dict[str, CountFn] = {"count_items": count_items}
    if torch.is_tensor(labels) and not labels.is_floating_point():
        counters["non-(-100) labels"] = lambda b: count_label_items(b["labels"])
        if labels.dim() > 1:
            counters["non-(-100) labels[..., 1:] (causal LM, shifted)"] = lambda b: count_label_items(
                b["labels"], shift_labels=True
            )
    counters[ROWS] = batch_rows
    return counters


def discriminating_cut(
    rows: dict[str, Any], candidates: Sequence[tuple[int, int]], count_items: CountFn, min_rows: int
) -> tuple[int, int, int] | None:
    """
    The batch `rows[start:stop]` and the cut `k` (parts `start:k`, `k:stop`) among `candidates` (row ranges) for
    which the counts of `_counters` give the two parts the most *different* weights, so that the competing
    explanations of the loss's denominator predict different losses. Parts have at least `min_rows` rows.

    The weights are compared as sorted pairwise differences (lexicographically): two counts that are proportional
    everywhere (every row has the same number of tokens) cannot be told apart by any cut and do not decide.
    """
    counters = _counters(count_items, rows.get("labels"))
    best, best_key = None, None
    for start, stop in candidates:
        for k in range(start + min_rows, stop - min_rows + 1):
            parts = [take_rows(rows, start, k), take_rows(rows, k, stop)]
            fractions = []
            for counter in counters.values():
                counts = [float(counter(p)) for p in parts]
                if sum(counts) > 0:
                    fractions.append(counts[0] / sum(counts))
            gaps = sorted(abs(a - b) for i, a in enumerate(fractions) for b in fractions[i + 1 :])
            key = [round(g, 9) for g in gaps if g > 1e-12]
            if best_key is None or key > best_key:
                best, best_key = (start, k, stop), key
    return best


def denominator_errors(
    model: nn.Module,
    loss_fn: LossFn,
    count_items: CountFn,
    rows: dict[str, Any],
    cut: tuple[int, int, int],
    device: torch.device,
    before_forward: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """For each count: the relative error of predicting `loss(batch)` as the count-weighted mean of the losses of its
    two parts (0 for the count the loss divides by)."""
    start, k, stop = cut
    batch, parts = take_rows(rows, start, stop), [take_rows(rows, start, k), take_rows(rows, k, stop)]
    losses = []
    with torch.no_grad():
        for b in (batch, *parts):
            before_forward()
            losses.append(float(loss_fn(model, to_device(b, device))))
    whole, halves = losses[0], losses[1:]
    errors: dict[str, float] = {}
    for name, counter in _counters(count_items, rows.get("labels")).items():
        counts = [float(counter(p)) for p in parts]
        if sum(counts) <= 0:
            continue
        predicted = sum(c * loss for c, loss in zip(counts, halves, strict=True)) / sum(counts)
        errors[name] = abs(predicted - whole) / max(abs(whole), 1e-30)
    return errors


def denominator_cause(errors: dict[str, float], rtol: float) -> Cause | None:
    """The count that reproduces the loss from its parts when `count_items` does not: `row_mean_loss` for rows (a
    per-sequence loss averaged over rows, CTC's `reduction="mean"`), `item_count_mismatch` for another count."""
    threshold = max(rtol, 1e-5)
    if errors.get("count_items", 0.0) <= threshold:
        return None
    matching = sorted((err, name) for name, err in errors.items() if name != "count_items" and err <= threshold)
    if not matching:
        return None
    err, name = matching[0]
    evidence = (
        f"weighting two parts of a batch by {name} reproduces its loss (relative error {err:.1e}), weighting them by "
        f"`count_items` does not ({errors['count_items']:.1e})."
    )
    if name == ROWS:
        return Cause(
            "row_mean_loss",
            "the loss is normalised per row (per sequence) and then averaged over rows, like CTC with "
            f"`reduction='mean'`, but the micro-batches are weighted by `count_items` (tokens): {evidence}",
            FIXES["row_mean_loss"],
        )
    return Cause(
        "item_count_mismatch",
        f"the loss is a mean over {name}, but the micro-batches are weighted by `count_items`: {evidence}",
        FIXES["item_count_mismatch"].format(count=name),
    )


def not_a_mean_cause(errors: dict[str, float]) -> Cause:
    shown = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    return Cause(
        "loss_not_an_item_mean",
        "the loss of a batch is not the count-weighted mean of the losses of its two parts for any count (relative "
        f"errors: {shown}): it couples the items of a micro-batch (e.g. a batch-level contrastive or ranking loss, "
        "or normalisation over the batch).",
        FIXES["loss_not_an_item_mean"],
    )


def stateful_cause(changed_buffers: Sequence[str], model: nn.Module) -> Cause | None:
    bn_prefixes = tuple(name + "." for name, m in model.named_modules() if isinstance(m, _BatchNorm))
    changed = [b for b in changed_buffers if not b.startswith(bn_prefixes)]
    if not changed:
        return None
    return Cause(
        "stateful_layers",
        f"forward passes updated buffers {changed[:8]}: the layers owning them change with every micro-batch, so "
        "2N forward passes compute something else than N.",
        FIXES["stateful_layers"],
        sorted({b.rsplit(".", 1)[0] for b in changed}),
    )


def nondeterminism_cause(rel_diff: float, sources: Sequence[str], modules: Sequence[str]) -> Cause:
    if sources:
        drawn = f"; a forward draws from {', '.join(sources)}: randomness the probe cannot switch off"
    else:
        drawn = (
            "; no random generator advanced during a forward: state kept outside buffers (attributes or parameters "
            "updated by the forward), or nondeterministic kernels"
        )
    return Cause(
        "nondeterministic_forward",
        f"the same split computed twice differs by {rel_diff:.2e} (relative) with every known random layer and "
        f"config switch neutralised{drawn}.",
        FIXES["nondeterministic_forward"],
        list(modules),
    )
