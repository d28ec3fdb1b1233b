"""`hf_gradaccum.GradientAccumulator`: the engine's accumulator, whose `backward(loss, batch=...)` weights a
transformers model's micro-batches by what its loss is measured to divide by, with the refusals of
`losses/rule.py`, settled on the first micro-batch it is given (before that micro-batch's gradients are
folded)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..engine.accumulator import GradientAccumulator as EngineAccumulator
from ..engine.loss_normalisation import NONE, LaterWindowCheck, NormalisationFinding, measure_loss_normalisation
from ..engine.reduction import world_size_and_rank
from ..verification.isolation import isolated_probe
from ..verification.split_invariance import tolerance_for
from ..verification.windows import concat_window, take_rows
from .model_inspection import unwrap_model
from .model_losses import (
    ModelLossError,
    in_model_contrastive,
    model_loss_terms,
    refuse_batchnorm,
    training_batchnorms,
)
from .moe import adds_router_loss
from .probe_gradients import gradient_residual_for, reduce_max_over_ranks

logger = logging.getLogger(__name__)


def _model_loss(base: nn.Module) -> tuple[Any, Any]:
    """The model's own loss of a batch, as a float (no graph) and with its graph; autocast off: the weighting does not
    depend on the precision, and the parameters' own separates rules best."""
    device_type = next((p.device.type for p in base.parameters()), "cpu")

    def loss_of(part: Mapping[str, Any]) -> float:
        with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
            return float(base(**part).loss.float())

    def loss_with_graph(part: Mapping[str, Any]) -> torch.Tensor:
        with torch.autocast(device_type=device_type, enabled=False):
            return base(**part).loss

    return loss_of, loss_with_graph


def settle_plain_loop_rule(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    prior: str,
    named: str,
    batchnorm_statistics: str,
    gradient_accumulation_steps: int,
    world_size: int,
    measure_gradients: bool,
) -> NormalisationFinding:
    """
    The weighting of `model`'s micro-batches in a plain loop, decided on `batch` (the first one given): the rule,
    or a `ModelLossError` before anything is folded.

    Example:

    ```python
    >>> finding = settle_plain_loop_rule(model, batch, prior="label_tokens", named="auto",
    ...     batchnorm_statistics="stop", gradient_accumulation_steps=8, world_size=1,
    ...     measure_gradients=True)  # doctest: +SKIP
    >>> finding.rule  # doctest: +SKIP
    'rows'
    ```
    """
    base = unwrap_model(model)
    name = type(base).__name__
    if gradient_accumulation_steps == 1 and world_size == 1:
        return NormalisationFinding(rule=prior, decided_by="prior", note="one micro-batch per window: any weighting")
    if training_batchnorms(base):
        if batchnorm_statistics == "stop":
            raise refuse_batchnorm(base)
        return NormalisationFinding(rule=prior, decided_by="declared", note='batchnorm_statistics="micro_batch"')
    if in_model_contrastive(base, batch):
        raise ModelLossError(
            f"{name} computes an in-batch contrastive loss (`return_loss=True`): every row's loss depends on the other "
            "rows of its batch, so no weighting of micro-batches equals the large batch. Stopped before anything was "
            "accumulated.\nFix: `CoupledLoss(embed_fn, loss_fn).accumulate_window(accumulator, model, micro_batches)` "
            "(docs/coupled_losses.md; `clip_coupled_loss()` for CLIP)."
        )
    if named != "auto":
        return NormalisationFinding(rule=named, decided_by="declared", note="named to the accumulator")
    if adds_router_loss(base):
        raise ModelLossError(
            f"{name} adds a router load-balancing loss, a statistic of its batch: per micro-batch it is another "
            "objective. Stopped before anything was accumulated.\nFix: `WindowRouterBalance` for the window's exact "
            'term (docs/moe_balance.md), or `loss_normalisation="shifted_label_tokens"` to keep the per-micro-batch '
            "term knowingly."
        )
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    loss_of, loss_with_graph = _model_loss(base)

    params = [p for p in base.parameters() if p.requires_grad]
    with isolated_probe(base):
        finding = measure_loss_normalisation(
            loss_of,
            [dict(batch)],
            take_rows=take_rows,
            concat=concat_window,
            prior=prior,
            tolerance=tolerance_for(dtype),
            reduce_max=reduce_max_over_ranks,
            gradient_residual=gradient_residual_for(params, loss_with_graph) if measure_gradients else None,
            # A model of transformers returns a mean; a class-weighted count is fitted on this process's cuts.
            sum_in_play=False,
            fit_classes=world_size == 1,
        )
    if finding.stop:
        raise ModelLossError(
            f"{name}: what its loss divides by could not be settled on its first micro-batch ({finding.stop}). "
            "Stopped before anything was accumulated.\nFix: pass `num_items=` with what the loss divides by, or "
            "`loss_normalisation=` naming it."
        )
    if finding.decided_by == "undecided":
        logger.warning(
            "GradientAccumulator: could not measure what %s's loss divides by on its first micro-batch (%s); "
            "counting %s. Pass `loss_normalisation=` to say it.",
            name,
            finding.note,
            prior,
        )
    if finding.rule == NONE:
        several = model_loss_terms(base, batch) is not None
        raise ModelLossError(
            f"{name}'s loss is not a mean over any count its batch carries, nor a sum ({finding.note}): "
            + (
                "it adds terms with their own counts, which a plain loop's single weight per micro-batch cannot make "
                "exact. Stopped before anything was accumulated.\nFix: `GradAccumTrainer` (it weights each term by "
                "its own count), or back-propagate `sum_t term_sum_t / window_count_t` yourself with `num_items=1` "
                'and `loss_normalisation="sum"`.'
                if several
                else "it couples the rows of a batch, so no weighting of micro-batches equals the large batch. "
                "Stopped before anything was accumulated.\nFix: `gradient_accumulation_steps=1`, or name the weighting "
                'you know is right (`loss_normalisation="rows"`, ...).'
            )
        )
    logger.info("GradientAccumulator: %s", finding.summary())
    return finding


class GradientAccumulator(EngineAccumulator):
    """
    [`~hf_gradaccum.engine.accumulator.GradientAccumulator`] whose `backward(loss, batch=...)` measures, on the first
    batch it is given, what a transformers model's loss divides by ([`settle_plain_loop_rule`]), and refuses a loss
    no weighting makes exact before anything is accumulated. Its arguments are the engine class's.

    Example:

    ```python
    >>> from hf_gradaccum import GradientAccumulator
    >>> accumulator = GradientAccumulator(model, gradient_accumulation_steps=8)  # doctest: +SKIP
    >>> accumulator.backward(model(**batch).loss, batch=batch)  # doctest: +SKIP
    >>> accumulator.normalisation.rule  # doctest: +SKIP
    'shifted_label_tokens'
    ```
    """

    def _settle_normalisation(self, batch: Mapping[str, Any], shift: bool | None) -> NormalisationFinding:
        world, _ = world_size_and_rank(self._reduce_gradients, self._data_parallel_group)
        return settle_plain_loop_rule(
            self._model,
            batch,
            prior=self.prior_rule(batch, shift),
            named=self.loss_normalisation,
            batchnorm_statistics=self.batchnorm_statistics,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            world_size=world,
            measure_gradients=not self.sharded and self._window is None,
        )

    # The first batch's tie (rules that weigh one micro-batch alike), re-weighed on every later batch against it.
    _tie: LaterWindowCheck | None = None
    _tie_reference: dict[str, Any] | None = None
    _tie_batches = 0

    def _resolve_num_items(
        self, num_items: int | float | torch.Tensor | None, batch: Mapping[str, Any] | None
    ) -> int | float | torch.Tensor | None:
        """The items of `batch` under the rule settled on the first batch; where rules tied there, each later batch
        re-weighs them against the first, before its gradients are folded (a contradicted rule stops)."""
        first = self.normalisation is None
        count = super()._resolve_num_items(num_items, batch)
        if batch is None or self.normalisation is None or self._model is None:
            return count
        if first:
            finding = self.normalisation
            if finding.decided_by in ("tie", "undecided") and len(finding.equivalent) > 1:
                self._tie = LaterWindowCheck(finding)
                self._tie_reference = {k: v.detach() if torch.is_tensor(v) else v for k, v in batch.items()}
        elif self._tie is not None and self._tie.active:
            self._tie_batches += 1
            base = unwrap_model(self._model)
            loss_of, _ = _model_loss(base)
            with isolated_probe(base):
                reason = self._tie.check(
                    [self._tie_reference, dict(batch)], f"batch {self._tie_batches + 1} (against the first)", loss_of,
                    take_rows=take_rows, concat=concat_window, reduce_max=reduce_max_over_ranks,
                )  # fmt: skip
            if reason:
                raise ModelLossError(
                    f"{type(base).__name__}: {reason}. Stopped before this micro-batch's gradients were folded (the "
                    "optimizer has not stepped on this window).\nFix: pass `num_items=` with what the loss divides "
                    "by, or `loss_normalisation=` naming it."
                )
        return count
