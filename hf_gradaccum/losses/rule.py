"""[`TrainerLossRule`]: how `GradAccumTrainer` weights a model's micro-batches, settled on the first window and
re-weighed on every later one.

Before the first optimizer step, with the window the Trainer has just prefetched (`get_batch_samples`), the rules of
`losses/model_losses.py` run in order: BatchNorm in training mode stops; an in-model contrastive loss takes the
coupled mode; a model's loss of several registered terms is weighted per term wherever its check passes; any other
loss, the model's or a user's `compute_loss`, is measured across the whole window (`engine/loss_normalisation/`) as
training computes it (`losses/trainer_probe.py`) and trained with the weighting found, or stopped with the cause
(`losses/normalisation_stops.py`). A declaration (a named `loss_normalisation`, a `count_micro_batch_items` override) is
checked against the same window. Rules the first window could not tell apart are re-weighed on every later window
from their counts, with one cut where they diverge. The finding is logged and written to
`output_dir/accumulation_check.json`, on a stop too. Composed trainers (TRL, sentence-transformers) keep the
composition registry's counting, which was proven for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..config.arguments import gradaccum_option
from ..engine.items import read_counts
from ..engine.loss_normalisation import (
    BOXES,
    LABEL_TOKENS,
    NONE,
    ROWS,
    SHIFTED_LABEL_TOKENS,
    SUM,
    CutFailed,
    LaterWindowCheck,
    NormalisationFinding,
    ProbeRaised,
    batch_count,
    batch_rows,
    measure_loss_normalisation,
    plan_cuts,
    row_counts,
)
from ..engine.loss_normalisation.cuts import build_cut
from ..engine.oom_retry import is_out_of_memory, release_cached_memory
from ..verification.isolation import isolated_probe
from ..verification.split_invariance import tolerance_for
from ..verification.windows import concat_window, take_rows
from .accumulation_check import CHECK_FILE_NAME
from .composed_class import library_trainer
from .declared_terms import DeclaredTerms
from .model_inspection import unwrap_model
from .model_losses import (
    DetectionTerms,
    ModelLossError,
    WindowTerms,
    check_contrastive_loss,
    contrastive_coupled_loss,
    in_model_contrastive,
    refuse_batchnorm,
    registered_rule,
    registered_terms,
    training_batchnorms,
)
from .moe import adds_router_loss
from .normalisation_stops import cut_failed_stop, declared_stop, loss_owner, normalisation_stop
from .probe_gradients import gradient_residual_for, reduce_max_over_ranks
from .trainer_probe import TrainerLossProbe, loss_class

logger = logging.getLogger(__name__)

# The name under which a user's `count_micro_batch_items` override is checked as a rule.
USER_COUNT = "count_micro_batch_items"


@contextlib.contextmanager
def _resharded_after(model: torch.nn.Module):
    """FSDP2 leaves parameters gathered after forwards that no backward follows: shard them again, as training
    expects to find them."""
    try:
        yield
    finally:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # torch without FSDP2
            return
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class _OutOfMemory(Exception):
    pass


@contextlib.contextmanager
def _out_of_memory_caught():
    """A forward of the probe out of memory (training's own retry chunks micro-batches; the probe does not)."""
    try:
        yield
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        release_cached_memory()
        raise _OutOfMemory() from error


def _engine_owns_gradients(trainer: Any) -> bool:
    from ..distributed.sharding import trainer_shards_gradients

    return trainer._deepspeed_window is not None or trainer_shards_gradients(trainer)


def _user_counter(trainer: Any) -> bool:
    """Whether a class of the user's overrides `count_micro_batch_items` (a declaration of the loss's count)."""
    counter = type(trainer).count_micro_batch_items
    return (counter.__module__, counter.__qualname__) != (
        "hf_gradaccum.trainer.trainer",
        "GradAccumTrainer.count_micro_batch_items",
    )


def _composed(trainer: Any) -> bool:
    """Whether the loss that trains is a composed library trainer's, or a `compute_loss_func`'s (both counted by
    the composition registry or by what they are handed)."""
    if callable(getattr(trainer, "compute_loss_func", None)):
        return True
    cls = library_trainer(trainer)
    return cls is not None and cls.__module__.split(".")[0] != "transformers"


def hands_stock_items(trainer: Any) -> bool:
    """Whether a user's `compute_loss` is handed the `num_items_in_batch` the stock Trainer would hand it (the
    measurement then sees, and weights, what that loss does with it)."""
    return (
        loss_class(trainer) is not None
        and not _composed(trainer)
        and trainer.coupled_mode is None
        and (trainer.moe_mode is None)
    )


class TrainerLossRule:
    """
    The weighting of a `GradAccumTrainer`'s micro-batches: `None` until settled (the count the trainer has always
    used: label tokens, shifted for causal LMs), then the rule found on the first window.

    Attributes:
        rule: a rule of `engine/loss_normalisation/`, `"coupled"`, `"terms"`, or `None` (not settled, or left to
            the trainer's own counting: a composed trainer's, a user's `count_micro_batch_items`).
        terms: the per-term weighting of a loss of several terms ([`WindowTerms`]).
        finding: what the measurement found (`None` where nothing was measured).
        recheck: the first window's tie, re-weighed on every later window (`None` where nothing tied).
    """

    def __init__(self) -> None:
        self.settled = False
        self.rule: str | None = None
        self.terms: WindowTerms | DetectionTerms | DeclaredTerms | None = None
        self.finding: NormalisationFinding | None = None
        self.recheck: LaterWindowCheck | None = None
        self.windows = 0
        # Wall time spent re-weighing the tie on later windows (its cost, for the benchmarks).
        self.recheck_seconds = 0.0

    @property
    def sums_losses(self) -> bool:
        """Whether each micro-batch's loss is already its share of the window's (not divided by the window's items)."""
        return self.rule in (SUM, "terms")

    def items_on_device(self, batch: Mapping[str, Any]) -> int | torch.Tensor | None:
        """The items of `batch` under the settled rule (`None`: the trainer's own count)."""
        if self.rule is None or self.rule == "coupled":
            return None
        if self.sums_losses:
            return 1
        return batch_count(self.rule, batch)

    def window_prefetched(self, trainer: Any, batches: list[Any]) -> None:
        """Settle the rule on the first window; afterwards, re-weigh its tie and prepare the per-term counts of every
        window."""
        if not batches:
            return
        self.windows += 1
        if not self.settled:
            self.settled = True
            self._settle(trainer, batches)
        elif self.recheck is not None and self.recheck.active:
            start = time.perf_counter()
            try:
                self._recheck(trainer, batches)
            finally:
                self.recheck_seconds += time.perf_counter() - start
        if self.terms is not None:
            self.terms.prepare(batches)

    # ------------------------------------------------------------------ the first window
    def _settle(self, trainer: Any, batches: list[Any]) -> None:
        args = trainer.args
        model = trainer.model
        if args.gradient_accumulation_steps == 1 and args.world_size == 1:
            return  # the micro-batch is the batch: any weighting is exact
        if training_batchnorms(model):
            if gradaccum_option(args, "batchnorm_statistics") == "stop":
                raise refuse_batchnorm(model)
            # Per-micro-batch statistics, named: the batch is coupled knowingly, so the values cannot add up; each
            # micro-batch keeps the trainer's own count.
            self._report(trainer, 'batchnorm_statistics="micro_batch": per-micro-batch BatchNorm statistics, as named')
            return
        if trainer.coupled_mode is not None:
            return  # a declared (or sentence-transformers') window loss
        first = batches[0] if isinstance(batches[0], Mapping) else {}
        if in_model_contrastive(model, first):
            coupled = contrastive_coupled_loss(model)
            with isolated_probe(model):
                check_contrastive_loss(coupled, model, trainer._prepare_inputs(first), 1e-4)
            trainer.use_coupled_loss(coupled)
            self.rule = "coupled"
            self._report(trainer, f"{type(unwrap_model(model)).__name__}'s in-batch contrastive loss: coupled mode")
            return
        if trainer.moe_mode is not None or adds_router_loss(model) or _composed(trainer):
            # The MoE window mode (a causal LM), or its per-micro-batch router term named knowingly; composed
            # trainers: the composition registry's proven counting.
            return
        prepared = [trainer._prepare_inputs(b) for b in batches]
        if not all(isinstance(b, Mapping) for b in prepared):
            return  # batches that are not dicts of rows: the trainer's own counting
        named = gradaccum_option(args, "loss_normalisation")
        check = gradaccum_option(args, "check_declared_normalisation")
        if _user_counter(trainer):
            if isinstance(trainer.count_micro_batch_items(prepared[0]), Mapping):
                self._settle_terms(trainer, prepared, check)
            else:
                self._settle_declared(trainer, prepared, USER_COUNT, check)
            return
        if named != "auto":
            self.rule = named
            self._settle_declared(trainer, prepared, named, check)
            return
        if loss_class(trainer) is None and self._registered_terms_hold(trainer, prepared):
            self._report(trainer, self.finding.summary())
            return
        self.finding = self._measure(trainer, prepared)
        if self.finding.stop:
            self._stop(trainer, normalisation_stop(trainer, self.finding))
        self.rule = self.finding.rule
        if self.rule == NONE:
            self.rule = None
            self._no_weighting(trainer, prepared)
        if self.finding.decided_by in ("tie", "undecided") and len(self.finding.equivalent) > 1:
            self.recheck = LaterWindowCheck(self.finding, label_name=self._label_name(trainer))
        if self.sums_losses and trainer._deepspeed_window is not None:
            self._stop(
                trainer,
                f"{loss_owner(trainer)}'s loss is {self._describe()}: under DeepSpeed the loss handed to its engine "
                "is weighted by items before the window's counts exist. Stopped before the first optimizer step.\n"
                "Fix: DDP (the accumulator sums there), or `gradient_accumulation_steps=1`.",
            )
        self._report(trainer, self.finding.summary())

    def _describe(self) -> str:
        return "a sum over its rows" if self.rule == SUM else "several terms, each with its own count"

    @staticmethod
    def _label_name(trainer: Any) -> str:
        return trainer.label_names[0] if trainer.label_names else "labels"

    def _prior(self, trainer: Any, batch: Mapping[str, Any]) -> str:
        """The rule the trainer's own count follows on `batch` (kept where rules tie with the same weights)."""
        labels = batch.get(self._label_name(trainer))
        if batch.get("shift_labels") is not None:
            return LABEL_TOKENS
        if labels is None:
            return ROWS
        if isinstance(labels, (list, tuple)):
            return BOXES
        labels = labels if torch.is_tensor(labels) else torch.as_tensor(labels)
        if labels.is_floating_point():
            return ROWS
        if labels.dim() > 1 and trainer._shifts_labels():
            return SHIFTED_LABEL_TOKENS
        return LABEL_TOKENS

    def _measure(self, trainer: Any, prepared: list[Any], *, declared: str | None = None,
                 counters: dict | None = None) -> NormalisationFinding:  # fmt: skip
        """The measurement over the window, the loss computed as training computes it; a fallback where it ran out
        of memory; the user's own error where their loss raised on a micro-batch as training hands it."""
        model = trainer.model
        prior = self._prior(trainer, prepared[0])
        probe = TrainerLossProbe(trainer, prepared)
        # The tolerance is the training precision's (the probe runs in it, as training does).
        dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        params = [p for p in model.parameters() if p.requires_grad]
        options = dict(
            take_rows=take_rows, concat=concat_window, prior=prior, tolerance=tolerance_for(dtype),
            label_name=self._label_name(trainer), reduce_max=reduce_max_over_ranks, declared=declared,
            counters=counters, sum_in_play=loss_class(trainer) is not None, fit_classes=trainer.args.world_size == 1,
            registered=None if loss_class(trainer) is not None else registered_rule(model),
            # Sharded engines own the gradients (their backward reduce-scatters into buffers of theirs): the loss
            # values decide alone there.
            gradient_residual=None if _engine_owns_gradients(trainer)
            else gradient_residual_for(params, probe.loss_with_graph),
        )  # fmt: skip
        try:
            with isolated_probe(model), _out_of_memory_caught(), _resharded_after(model):
                return measure_loss_normalisation(probe.loss_of, prepared, **options)
        except ProbeRaised as raised:
            error = raised.error
            error.add_note(
                f"GradAccumTrainer: raised by {loss_owner(trainer)} on a micro-batch of the first window, as training "
                "hands it, while measuring what the loss divides by (before the first optimizer step)."
            )
            raise error from None
        except CutFailed as failed:
            self._stop(trainer, cut_failed_stop(trainer, failed), cause=failed)
        except _OutOfMemory:
            # Nothing measured: the same verdict as for no cut at all, from the counts alone.
            with isolated_probe(model), _resharded_after(model):
                finding = measure_loss_normalisation(probe.loss_of, prepared, **{**options, "max_cuts": 0})
            finding.note = "the probe ran out of memory even on cuts of two rows; " + finding.note
            if finding.stop:
                finding.stop = "the probe ran out of memory even on cuts of two rows; " + finding.stop
            return finding

    def _settle_declared(self, trainer: Any, prepared: list[Any], declared: str, check: bool) -> None:
        """A named rule, or the user's `count_micro_batch_items`: checked against the window unless switched off."""
        what = (
            f"`{type(trainer).__name__}.count_micro_batch_items`" if declared == USER_COUNT
            else f'`loss_normalisation="{declared}"`'
        )  # fmt: skip
        if not check:
            self.finding = NormalisationFinding(rule=declared, decided_by="declared", note=f"{what}, unchecked")
        else:
            counters = None
            if declared == USER_COUNT:
                counters = {USER_COUNT: lambda b: float(read_counts([trainer.count_micro_batch_items(b)])[0])}
            self.finding = self._measure(trainer, prepared, declared=declared, counters=counters)
            if self.finding.stop:
                self._stop(trainer, declared_stop(trainer, self.finding, what))
            self.finding.note = f"{what}: " + self.finding.note
        if declared == USER_COUNT:
            self.rule = None  # the trainer counts with the override itself
        self._report(trainer, self.finding.summary())

    def _settle_terms(self, trainer: Any, prepared: list[Any], check: bool) -> None:
        """A user's loss of several terms, declared (`count_micro_batch_items` returns each term's count, `mean_terms`
        combines them): each micro-batch's share summed. Checked: the shares must add up over cuts like a sum."""
        self.terms = DeclaredTerms(trainer)
        self.terms.prepare(prepared)
        self.rule = "terms"
        what = f"the terms `{type(trainer).__name__}.count_micro_batch_items` declares"
        if not check:
            self.finding = NormalisationFinding(rule="terms", decided_by="declared", note=f"{what}, unchecked")
        else:
            self.finding = self._measure(trainer, prepared, declared=SUM)
            if self.finding.stop:
                self._stop(trainer, declared_stop(trainer, self.finding, what + " (combined by `mean_terms`)"))
            self.finding.rule = "terms"
            self.finding.note = f"{what}: each term a mean over its own count; " + self.finding.note
        self._report(trainer, self.finding.summary())

    def _registered_terms_hold(self, trainer: Any, prepared: list[Any]) -> bool:
        """A model's registered weighting per term, used whenever its check passes (before any single rule, which
        may fit by coincidence)."""
        terms = registered_terms(trainer.model, prepared[0])
        if terms is None or (isinstance(terms, DetectionTerms) and trainer.args.world_size > 1):
            return False
        dtype = next((p.dtype for p in trainer.model.parameters() if p.is_floating_point()), torch.float32)
        self.finding = NormalisationFinding(rule="terms", decided_by="registry", tolerance=tolerance_for(dtype))
        mismatch = self._check_terms(trainer, terms, prepared)
        if mismatch:
            logger.info("GradAccumTrainer: the registered terms do not describe this loss (%s); measuring.", mismatch)
            self.finding = None
            return False
        self.rule, self.terms = "terms", terms
        self.finding.note = f"a sum of terms, each divided by its own count ({type(terms).__name__})"
        return True

    # ------------------------------------------------------------------ later windows
    def _recheck(self, trainer: Any, batches: list[Any]) -> None:
        prepared = [trainer._prepare_inputs(b) for b in batches]
        probe = TrainerLossProbe(trainer, prepared)
        window = f"window {self.windows} (before optimizer step {trainer.state.global_step + 1})"
        with isolated_probe(trainer.model), _resharded_after(trainer.model):
            reason = self.recheck.check(
                prepared, window, probe.loss_of, take_rows=take_rows, concat=concat_window,
                reduce_max=reduce_max_over_ranks,
            )  # fmt: skip
        if reason:
            self.finding.stop, self.finding.decided_by = reason, "stopped"
            self._stop(trainer, normalisation_stop(trainer, self.finding, window=window.split(" (")[0]))

    def _stop(self, trainer: Any, message: str, cause: BaseException | None = None) -> None:
        """Write what was found, then stop before the optimizer step."""
        self._report(trainer, message.splitlines()[0], stopped=True)
        raise ModelLossError(message) from cause

    def _no_weighting(self, trainer: Any, prepared: list[Any]) -> None:
        """No weighting holds (a registered loss of several terms was tried first): stop, naming the class whose code
        computes the loss and what would make it exact."""
        self.finding.stop = self.finding.note
        self._stop(trainer, normalisation_stop(trainer, self.finding))

    def _check_terms(self, trainer: Any, terms: Any, prepared: list[Any]) -> str:
        """Empty if the registered terms add up to the model's own loss on the first micro-batch and, on a cut across
        the window's micro-batches, the gradient of their sums adds up too (counts the values alone cannot check)."""
        model = trainer.model
        tolerance = self.finding.tolerance
        with isolated_probe(model), torch.no_grad(), trainer.compute_loss_context_manager():
            loss, outputs = trainer.compute_loss(model, dict(prepared[0]), return_outputs=True)
            mismatch = terms.check_against(loss, outputs, prepared[0], tolerance * 10)
        if mismatch or _engine_owns_gradients(trainer):
            return mismatch
        label_name = self._label_name(trainer)
        table = {LABEL_TOKENS: [row_counts(LABEL_TOKENS, b, label_name=label_name) for b in prepared]}
        table = {k: v for k, v in table.items() if all(x is not None for x in v)}
        cut = None
        for plan in plan_cuts(table, [batch_rows(b) for b in prepared]):
            try:
                cut = build_cut(plan, prepared, take_rows, concat_window)
                break
            except ValueError:
                continue
        if cut is None:
            return ""
        whole, part_a, part_b = cut
        terms.prepare([whole])

        def share_with_graph(batch: Mapping[str, Any]) -> torch.Tensor:
            with trainer.compute_loss_context_manager():
                _, out = trainer.compute_loss(model, dict(batch), return_outputs=True)
            return terms.micro_batch_loss(out, batch)

        params = [p for p in model.parameters() if p.requires_grad]
        with isolated_probe(model):
            residual = gradient_residual_for(params, share_with_graph)([(whole, 1.0), (part_a, -1.0), (part_b, -1.0)])
        self.finding.gradient_residuals["terms"] = residual
        return (
            "" if not residual > tolerance else f"their sums do not add up over a cut (gradient off by {residual:.2g})"
        )

    def _report(self, trainer: Any, summary: str, *, stopped: bool = False) -> None:
        (logger.error if stopped else logger.info)("GradAccumTrainer: %s", summary)
        if not trainer.is_world_process_zero():
            return
        path = os.path.join(trainer.args.output_dir, CHECK_FILE_NAME)
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        record: dict[str, Any] = {}
        if os.path.isfile(path):
            with open(path) as f:
                record = json.load(f)
        record["model"] = type(unwrap_model(trainer.model)).__name__
        record["loss_computed_by"] = loss_owner(trainer)
        record["loss_normalisation"] = (
            self.finding.to_dict() if self.finding is not None else {"rule": self.rule, "note": summary}
        )
        record["loss_normalisation"]["windows_rechecked"] = self.recheck.windows_checked if self.recheck else 0
        record["loss_normalisation"]["recheck_seconds"] = self.recheck_seconds
        if stopped:
            record["stopped"] = summary
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
