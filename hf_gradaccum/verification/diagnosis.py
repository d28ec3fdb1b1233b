"""Why a split changed the gradient: the known causes, each detected on the model and the data, with its fix.

Each cause is detected by what it *does*, not only by what the model is called:
- BatchNorm-family layers in training mode (normalise by the micro-batch's statistics): found by type.
- A mixture-of-experts router loss (load balancing over the micro-batch's tokens): `config.output_router_logits`
  with a non-zero `router_aux_loss_coef`.
- A loss that is a sum: the loss of a micro-batch concatenated with itself is twice its loss (a mean's is equal).
- Item counts that disagree with the loss's own denominator: the loss of a micro-batch is compared with the
  count-weighted mean of the losses of its two halves, for each way of counting (`count_items`, non-(-100) labels,
  `labels[..., 1:]`, rows); the one that reproduces it is what the loss divides by.
- Stateful layers: buffers other than BatchNorm's that the forward passes changed (spectral norm, EMA layers).
- A forward that is not deterministic: the reference split run twice gives two gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..engine.items import count_items as count_label_items
from .gradients import CountFn, LossFn, to_device
from .windows import take_rows

NORMALIZATION_FIX = (
    "replace them with GroupNorm (`hf_gradaccum.helpers.normalization.convert_batchnorm_to_groupnorm(model)`, exact) "
    "or freeze them (`freeze_batchnorm(model)`: fixed running statistics, exact), or accept that the gradient "
    "differs from the large batch's (`batchnorm_momentum_correction=True` then at least keeps the running "
    "statistics' decay per optimizer step)."
)


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
        NORMALIZATION_FIX,
        names,
    )


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
                "set `config.output_router_logits=False` (no auxiliary loss: the LM loss accumulates exactly), or "
                "accept a deviation of the order of `router_aux_loss_coef` in the router gradients.",
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
        "return a mean over items from the loss (`reduction='mean'`, or divide the sum by the number of items), or "
        "divide it by the micro-batch's item count in `compute_loss`.",
    )


def denominator_cause(
    model: nn.Module,
    loss_fn: LossFn,
    count_items: CountFn,
    batch: dict[str, Any],
    device: torch.device,
    rtol: float,
) -> Cause | None:
    """Which count makes `loss(batch)` the count-weighted mean of the losses of its two halves."""
    rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)
    halves = [take_rows(batch, 0, (rows + 1) // 2), take_rows(batch, (rows + 1) // 2, rows)]
    with torch.no_grad():
        whole = float(loss_fn(model, to_device(batch, device)))
        parts = [float(loss_fn(model, to_device(h, device))) for h in halves]
    labels = batch.get("labels")
    counters: dict[str, Callable[[dict[str, Any]], float]] = {"count_items": count_items}
    if torch.is_tensor(labels) and not labels.is_floating_point():
        counters["non-(-100) labels"] = lambda b: count_label_items(b["labels"])
        if labels.dim() > 1:
            counters["non-(-100) labels[..., 1:] (causal LM, shifted)"] = lambda b: count_label_items(
                b["labels"], shift_labels=True
            )
    counters["rows"] = lambda b: next(v.shape[0] for v in b.values() if torch.is_tensor(v) and v.dim() > 0)
    errors: dict[str, float] = {}
    for name, counter in counters.items():
        counts = [float(counter(h)) for h in halves]
        if sum(counts) <= 0:
            continue
        predicted = sum(c * loss for c, loss in zip(counts, parts, strict=True)) / sum(counts)
        errors[name] = abs(predicted - whole) / max(abs(whole), 1e-30)
    threshold = max(rtol, 1e-5)
    if errors.get("count_items", 0.0) <= threshold:
        return None
    matching = [name for name, err in errors.items() if name != "count_items" and err <= threshold]
    if not matching:
        return None
    return Cause(
        "item_count_mismatch",
        f"the loss is a mean over {matching[0]}, but the micro-batches are weighted by `count_items`: weighting the "
        f"two halves of a micro-batch by {matching[0]} reproduces its loss (relative error "
        f"{errors[matching[0]]:.1e}), weighting them by `count_items` does not ({errors['count_items']:.1e}).",
        f"count what the loss divides by ({matching[0]}): in GradAccumTrainer override `count_micro_batch_items` "
        "(or set `count_shifted_labels` for a causal LM the trainer cannot recognise); in a plain loop pass that "
        "count to `accumulator.backward(loss, num_items=...)`.",
    )


def not_a_mean_cause() -> Cause:
    return Cause(
        "loss_not_an_item_mean",
        "the loss of a micro-batch is not the count-weighted mean of the losses of its halves for any count "
        "(`count_items`, labels, shifted labels, rows): it couples the items of a micro-batch (e.g. a batch-level "
        "contrastive or ranking loss, or normalisation over the batch).",
        "use a loss that is a mean over independent items, or accept that accumulation approximates the large batch. "
        "In-batch negatives (contrastive, ranking): use the coupled-loss mode (`hf_gradaccum.CoupledLoss`), exact.",
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
        "put those layers in eval mode during training, or update their state once per optimizer step.",
        sorted({b.rsplit(".", 1)[0] for b in changed}),
    )


def nondeterminism_cause(rel_diff: float) -> Cause:
    return Cause(
        "nondeterministic_forward",
        f"the same split computed twice differs by {rel_diff:.2e} (relative): a random or nondeterministic layer "
        "that the probe did not neutralise (not an nn.Dropout module), or nondeterministic kernels.",
        "disable that randomness for the check, or set `torch.use_deterministic_algorithms(True)`.",
    )
