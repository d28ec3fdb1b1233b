"""[`TrainerLossRule`]: how `GradAccumTrainer` weights a model's micro-batches, settled on the first window.

Before the first optimizer step, with the window the Trainer has just prefetched (`get_batch_samples`), the rules of
`losses/model_losses.py` run in order: BatchNorm in training mode stops; an in-model contrastive loss takes the
coupled mode; a model's loss of several registered terms is weighted per term; any other model's loss is measured
(`engine/loss_normalisation.py`) and trained with the weighting found, or stopped with the cause. The finding is
logged and written to `output_dir/accumulation_check.json`. Composed trainers (TRL, sentence-transformers) keep the
composition registry's counting, which was proven for them; a user's `count_micro_batch_items` override is a
declaration and is never second-guessed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config.arguments import gradaccum_option
from ..engine.loss_normalisation import (
    BOXES,
    LABEL_TOKENS,
    NONE,
    ROWS,
    SHIFTED_LABEL_TOKENS,
    SUM,
    CutFailed,
    NormalisationFinding,
    batch_count,
    measure_loss_normalisation,
    window_cuts,
)
from ..engine.oom_retry import is_out_of_memory, release_cached_memory
from ..verification.isolation import isolated_probe
from ..verification.split_invariance import tolerance_for
from ..verification.windows import concat_window, take_rows
from .accumulation_check import CHECK_FILE_NAME
from .composed_class import library_trainer
from .model_inspection import unwrap_model
from .model_losses import (
    DetectionTerms,
    ModelLossError,
    WindowTerms,
    check_contrastive_loss,
    contrastive_coupled_loss,
    in_model_contrastive,
    refuse_batchnorm,
    registered_terms,
    training_batchnorms,
)
from .moe import adds_router_loss
from .probe_gradients import gradient_residual_for, reduce_max_over_ranks

logger = logging.getLogger(__name__)


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


def _full_precision(trainer: Any) -> contextlib.AbstractContextManager:
    """Autocast off for the probe's forwards where it is only a context (the parameters' own precision separates the
    rules best); a forward Accelerate wrapped in autocast keeps it."""
    return torch.autocast(device_type=trainer.args.device.type, enabled=False)


class _OutOfMemory(Exception):
    pass


@contextlib.contextmanager
def _undecided_on_out_of_memory(prior: str):
    """A forward of the probe out of memory (training's own retry chunks micro-batches; the probe does not): the
    measurement gives up, and the trainer's own count is kept, said so."""
    finding = NormalisationFinding(rule=prior, decided_by="undecided", note="the probe ran out of memory")
    try:
        yield finding
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        release_cached_memory()
        raise _OutOfMemory(finding) from error


def _engine_owns_gradients(trainer: Any) -> bool:
    from ..distributed.sharding import trainer_shards_gradients

    return trainer._deepspeed_window is not None or trainer_shards_gradients(trainer)


class TrainerLossRule:
    """
    The weighting of a `GradAccumTrainer`'s micro-batches: `None` until settled (the count the trainer has always
    used: label tokens, shifted for causal LMs), then the rule found on the first window.

    Attributes:
        rule: a rule of `engine/loss_normalisation.py`, `"coupled"`, `"terms"`, or `None` (not settled, or left to
            the trainer's own counting).
        terms: the per-term weighting of a loss of several terms ([`WindowTerms`]).
        finding: what the measurement found (`None` where nothing was measured).
    """

    def __init__(self) -> None:
        self.settled = False
        self.rule: str | None = None
        self.terms: WindowTerms | DetectionTerms | None = None
        self.finding: NormalisationFinding | None = None

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
        """Settle the rule on the first window; afterwards, the per-term counts of every window."""
        if not self.settled and batches:
            self.settled = True
            self._settle(trainer, batches)
        if self.terms is not None and batches:
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
        named = gradaccum_option(args, "loss_normalisation")
        if trainer.moe_mode is not None or adds_router_loss(model) or not self._model_loss_trains(trainer):
            # The MoE window mode (a causal LM), or its per-micro-batch router term named knowingly; composed
            # trainers: the composition registry's proven counting.
            return
        if named != "auto":
            self.rule = named
            self.finding = NormalisationFinding(rule=named, decided_by="declared", note="named in the arguments")
        else:
            try:
                self.finding = self._measure(trainer, batches)
            except CutFailed as failed:
                raise ModelLossError(
                    f"{type(unwrap_model(model)).__name__}: what its loss divides by could not be measured, because "
                    f"its forward fails on some rows of a micro-batch ({failed}); rows of its batch may refer to one "
                    "another (indices into the whole batch), which no weighting of micro-batches can follow. Stopped "
                    "before the first optimizer step.\nFix: name the weighting you know is right "
                    '(`loss_normalisation="rows"`, `"label_tokens"`, `"sum"`, ...), or `gradient_accumulation_steps=1`.'
                ) from failed
            except _OutOfMemory as stopped:
                self.finding = stopped.args[0]
                logger.warning("GradAccumTrainer: %s; counting as %s.", self.finding.note, self.finding.rule)
            self.rule = self.finding.rule
        if self.rule == NONE:
            self.rule = None
            self._no_weighting(trainer, batches)
        if self.sums_losses and trainer._deepspeed_window is not None:
            raise ModelLossError(
                f"{type(unwrap_model(model)).__name__}'s loss is {self._describe()}: under DeepSpeed the loss handed "
                "to its engine is weighted by items before the window's counts exist. Stopped before the first "
                "optimizer step.\nFix: DDP (the accumulator sums there), or `gradient_accumulation_steps=1`."
            )
        self._report(trainer, self.finding.summary() if self.finding else f"loss normalisation: {self.rule}")

    def _describe(self) -> str:
        return "a sum over its rows" if self.rule == SUM else "several terms, each with its own count"

    @staticmethod
    def _model_loss_trains(trainer: Any) -> bool:
        """Whether the loss that trains is the model's own (or a user's subclass's), not a composed library
        trainer's, and the user declared no count of their own."""
        counter = type(trainer).count_micro_batch_items
        if (counter.__module__, counter.__qualname__) != (
            "hf_gradaccum.trainer.trainer",
            "GradAccumTrainer.count_micro_batch_items",
        ):
            return False  # a user's override: a declaration
        if callable(getattr(trainer, "compute_loss_func", None)):
            return False
        cls = library_trainer(trainer)
        return cls is None or cls.__module__.split(".")[0] == "transformers"

    def _prior(self, trainer: Any, batch: Mapping[str, Any]) -> str:
        """The rule the trainer's own count follows on `batch` (kept where the data cannot tell rules apart)."""
        label_name = trainer.label_names[0] if trainer.label_names else "labels"
        labels = batch.get(label_name)
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

    def _measure(self, trainer: Any, batches: list[Any]) -> NormalisationFinding:
        model = trainer.model
        prepared = [trainer._prepare_inputs(b) for b in batches]
        prior = self._prior(trainer, prepared[0])
        label_name = trainer.label_names[0] if trainer.label_names else "labels"

        def loss_of(batch: Mapping[str, Any]) -> float:
            with torch.no_grad(), _full_precision(trainer):
                return float(trainer.compute_loss(model, dict(batch)).float())

        def loss_fn(module: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            with trainer.compute_loss_context_manager():
                return trainer.compute_loss(module, batch)

        params = [p for p in model.parameters() if p.requires_grad]

        def loss_with_graph(batch: Mapping[str, Any]) -> torch.Tensor:
            with _full_precision(trainer):
                return trainer.compute_loss(model, dict(batch))

        # Autocast stays on where Accelerate wrapped the model's forward in it: the tolerance is the precision's.
        dtype = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        with isolated_probe(model), _undecided_on_out_of_memory(prior), _resharded_after(model):
            return measure_loss_normalisation(
                loss_of,
                prepared,
                take_rows=take_rows,
                concat=concat_window,
                prior=prior,
                tolerance=tolerance_for(dtype),
                label_name=label_name,
                reduce_max=reduce_max_over_ranks,
                # Sharded engines own the gradients (their backward reduce-scatters into buffers of theirs): the
                # loss values decide alone there.
                gradient_residual=None
                if _engine_owns_gradients(trainer)
                else gradient_residual_for(params, loss_with_graph),
            )

    def _no_weighting(self, trainer: Any, batches: list[Any]) -> None:
        """No single weighting holds: a registered loss of several terms is weighted per term, once its terms are
        shown to add up to the model's loss and their sums to add up over a cut; anything else stops."""
        model = trainer.model
        prepared = [trainer._prepare_inputs(b) for b in batches]
        terms = registered_terms(model, prepared[0])
        name = type(unwrap_model(model)).__name__
        mismatch = "not registered"
        if terms is not None and isinstance(terms, DetectionTerms) and trainer.args.world_size > 1:
            mismatch = "a detection loss under several processes (the model all-reduces its box count in forward)"
        elif terms is not None:
            mismatch = self._check_terms(trainer, terms, prepared)
            if not mismatch:
                self.rule, self.terms = "terms", terms
                self.finding.rule, self.finding.decided_by = "terms", "registry"
                self.finding.note = f"a sum of terms, each divided by its own count ({type(terms).__name__})"
                return
        raise ModelLossError(
            f"{name}'s loss is not a mean over any count its batch carries, nor a sum ({self.finding.note}; "
            f"terms: {mismatch}): it couples the rows of a batch (a statistic of the batch, such as an auxiliary "
            "loss) or adds terms with different counts, so no weighting of micro-batches equals the large batch. "
            "Stopped before the first optimizer step.\nFix: `gradient_accumulation_steps=1` with the batch you "
            'want, or name the weighting you know is right (`loss_normalisation="rows"`, ...), or a '
            "`coupled_loss=` for a loss over the whole window (docs/coupled_losses.md)."
        )

    def _check_terms(self, trainer: Any, terms: Any, prepared: list[Any]) -> str:
        """Empty if the registered terms add up to the model's own loss on the first micro-batch and, on the first
        cut, the gradient of their sums adds up too (counts that the values alone cannot check)."""
        model = trainer.model
        tolerance = self.finding.tolerance
        with isolated_probe(model), torch.no_grad(), trainer.compute_loss_context_manager():
            loss, outputs = trainer.compute_loss(model, dict(prepared[0]), return_outputs=True)
            mismatch = terms.check_against(loss, outputs, prepared[0], tolerance * 10)
        cuts = window_cuts(prepared, take_rows, concat_window)
        if mismatch or not cuts or _engine_owns_gradients(trainer):
            return mismatch
        whole, part_a, part_b = cuts[0]
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

    def _report(self, trainer: Any, summary: str) -> None:
        logger.info("GradAccumTrainer: %s", summary)
        if not trainer.is_world_process_zero():
            return
        path = os.path.join(trainer.args.output_dir, CHECK_FILE_NAME)
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        record: dict[str, Any] = {}
        if os.path.isfile(path):
            with open(path) as f:
                record = json.load(f)
        record["model"] = type(unwrap_model(trainer.model)).__name__
        record["loss_normalisation"] = (
            self.finding.to_dict() if self.finding is not None else {"rule": self.rule, "note": summary}
        )
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
