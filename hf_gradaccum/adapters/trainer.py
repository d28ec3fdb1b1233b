"""`GradAccumTrainer`: a `transformers.Trainer` whose gradient accumulation is exactly the large-batch update.

This class is a thin adapter: the accumulation itself (buffers, weighting, reduction, overflow handling, the
out-of-memory window retry) lives in the engine ([`GradientAccumulator`], `engine/oom_retry.py`), which plain PyTorch /
Accelerate loops use directly. The Trainer's own loop is left alone; with every accumulation option at its default, a
run behaves as the stock `Trainer` in everything but the gradient it steps with (docs/trainer_fidelity.md lists the
differences). Public methods overridden:

- `get_batch_samples`: count the window's items from the labels (for the logged loss only); composed with TRL's
  KTOTrainer, compute the window's KL baseline in a forward-only pass (`adapters/trl_kto.py`); in the coupled-loss
  and MoE window modes, prepare the window (`adapters/coupled.py`, `adapters/moe.py`);
- `training_step`: each micro-batch goes through the parent classes' own `training_step`, `compute_loss` and
  `accelerator.backward`, unpatched (so a composed TRL/Seq2Seq trainer keeps its contexts, metrics and auxiliary
  losses), between the accumulator's `begin_micro_batch` and `end_micro_batch`, whose hooks fold the gradients
  item-weighted; where the loss must change before its backward (fp16 loss scaling, FSDP2), Accelerate hands it to
  the scaler installed here (`WindowGradScaler`), which asks the accumulator; after an fp16 overflow only that
  micro-batch's `compute_loss` and backward run again; on the window's last micro-batch, write the large-batch
  mean gradient into `.grad` for the Trainer's clipping and `optimizer.step()` (on the in-place path the window
  ends inside the clipping instead, which then divides, checks and clips in one go: `adapters/window_end.py`); with `auto_find_batch_size=True`, an
  out-of-memory error inside it shrinks the micro-batch and redoes the window (the effective batch is kept); under
  DeepSpeed, no accumulator: the loss Accelerate hands to DeepSpeed's engine is weighted instead
  (`adapters/deepspeed.py`);
- `compute_loss`: the parents' own, except in the coupled-loss mode (the micro-batch's share of the window loss) and
  the MoE window mode (the model's router term replaced by the window's exact one);
- `_clip_grad_norm` / `_get_grad_norm` (private, guarded): end a window left to the clipping;
- `get_train_dataloader`: with `effective_batch_size`, the stock loader on a batch sampler of the run's windows
  (`adapters/run_batch.py`); the stock one otherwise;
- `log`: add the accumulator's counters (`accumulator/*` keys);
- `train` / `save_model`: the accumulator's state (loss scale, counters) in every checkpoint and back on resume.

Modes: `coupled_loss=` (a constructor argument, as transformers takes `compute_loss_func`) for a loss over the whole
window (in-batch negatives); `moe_load_balance="window"` (an argument field) for exact MoE load balancing.
Opt-in policies (off by default): `take_back_skipped_steps` and the effective-batch policies (`lr_scaling_rule`,
`batchnorm_momentum_correction`) are callbacks the fields add ([`EffectiveBatchCallback`] also works with any
`Trainer`); `refuse_resume_with_different_batch` is checked when `train()` resumes; `atomic_checkpoints` wraps
`_save_checkpoint` (no callback runs before the files are written).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ..engine.accumulator import GradientAccumulator, WindowResult
from ..engine.coupled import CoupledLoss
from ..engine.items import items_on_device, read_counts
from ..engine.loss_scaling import DynamicLossScaler
from ..engine.oom_retry import WindowOOMRetry
from ..helpers.lr_scaling import effective_batch_size
from ..helpers.planning import AccumulationPlan
from .accumulation_check import check_trainer_window, should_verify
from .arguments import gradaccum_option, validate_gradaccum_fields
from .atomic_checkpoints import save_checkpoint_atomically
from .compat import (
    ATOMIC_CHECKPOINT_PRIVATE_NAMES,
    CORE_PRIVATE_NAMES,
    require_private_names,
    trainer_reads_loss_is_scaled_for_ga,
)
from .compositions import CompositionError, refuse_unaccumulable_losses, unknown_composed_trainer
from .coupled import CoupledWindowMode
from .deepspeed import DeepSpeedWindow, deepspeed_enabled
from .effective_batch import EffectiveBatchCallback
from .loss_counting import (
    WindowLossLog,
    counting_at_the_loss,
    divides_by_handed_count,
    hands_batch_to_loss_unchanged,
    refuse_rebuilt_micro_batches,
    training_step_passes_through,
)
from .loss_handover import backward_through
from .loss_rule import TrainerLossRule
from .model_inspection import loss_shifts_labels
from .moe import MoEWindowMode, adds_router_loss, window_router_mode
from .parallelism import data_parallel_group
from .run_batch import RunBatchMode
from .sharding import check_trainer_engine, trainer_shards_gradients
from .step_gating import SkippedStepCallback, WindowGradScaler
from .trl_dpo_sorted import WindowSortedLoss, window_sorted_loss_for
from .trl_generating import handed_window_share, rebuilt_batch_accumulation_for
from .trl_grpo import GenerationBatchAccumulation, generation_accumulation_for
from .trl_grpo_entropy import WindowEntropyQuantile, window_entropy_quantile_for
from .trl_kto import WindowKLBaseline, install_window_pairing, window_kl_baseline_for
from .trl_loss_terms import WindowTermWeights, window_term_weights_for
from .window_end import WindowEndAtClipping

ACCUMULATOR_STATE_NAME = "accumulator_state.pt"

logger = logging.getLogger(__name__)


class GradAccumTrainer(Trainer):
    """
    Drop-in replacement for [`~transformers.Trainer`] whose optimizer step under `gradient_accumulation_steps=N`
    equals the step of one batch of `N * per_device_train_batch_size * world_size` samples, for any model head:
    each micro-batch's mean loss is weighted by its item count (non-`-100` labels, shifted for causal LMs, one per
    row for sequence labels) and gradients are summed in fp32 buffers. Accepts [`GradAccumArguments`] or a plain
    `TrainingArguments` (then with the default accumulation options).

    Runs under DDP, FSDP2 and DeepSpeed ZeRO 1/2/3 (docs/engines.md lists what each engine supports).

    Composes with other `Trainer` subclasses in either order, e.g. `class MyTrainer(GradAccumTrainer, SFTTrainer)`
    or `(SFTTrainer, GradAccumTrainer)`: each micro-batch still runs through the
    parents' own `training_step` and `compute_loss` (their contexts, metrics and auxiliary losses); only the
    backward is routed through the accumulator. Add the options to their arguments with [`GradAccumFields`].

    Args:
        coupled_loss ([`CoupledLoss`], *optional*): a loss over the whole window rather than a mean over
            independent items (in-batch negatives: CLIP, ranking losses). Trained exactly by gradient caching
            (docs/coupled_losses.md): each window's representations first, then each micro-batch's share. Use a
            data collator that returns the dict its `embed_fn` expects, and `remove_unused_columns=False`. With
            another trainer, put `GradAccumTrainer` first in the class order.
        *args, **kwargs: those of [`~transformers.Trainer`] (or of the composed trainer).

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumArguments, GradAccumTrainer
    >>> args = GradAccumArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=8)
    >>> trainer = GradAccumTrainer(model=model, args=args, train_dataset=train_dataset)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> # a loss over the whole window (in-batch negatives):
    >>> from hf_gradaccum import ranking_coupled_loss
    >>> trainer = GradAccumTrainer(model=encoder, args=args, train_dataset=pairs, data_collator=collate,
    ...                            coupled_loss=ranking_coupled_loss(scale=20.0))  # doctest: +SKIP
    ```
    """

    # The two modes that replace the loss (set in `__init__`; class-level so that a composed parent's `__init__`, which
    # may run first, sees them unset).
    coupled_mode: CoupledWindowMode | None = None
    moe_mode: MoEWindowMode | None = None
    # Set while one micro-batch runs: where the installed scaler hands the loss (`_parent_training_step`).
    _hand_over: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Under DeepSpeed: the weight of each micro-batch's loss handed to its engine (`adapters/deepspeed.py`).
    _deepspeed_window: DeepSpeedWindow | None = None
    # What `_get_accumulator` and `_install_loss_handover` decided last (asked at every micro-batch).
    _accumulator_model: nn.Module | None = None
    _handover_decided: tuple[Any, GradientAccumulator | None] | None = None
    # `effective_batch_size`: this class's `get_train_dataloader` builds the run's windows (`adapters/run_batch.py`).
    _honours_run_batch = True
    _run_batch: RunBatchMode | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> GradAccumTrainer:
        if kwargs.get("coupled_loss") is not None:
            require_first_in_class_order(cls, "`coupled_loss`")
        trainer = super().__new__(cls)
        # TRL's KTOTrainer builds its KL pairs while preparing its datasets, in its own `__init__`, which runs before
        # this class's when it comes first in the class order: they are made the large batch's here
        # (`adapters/trl_kto.py`).
        install_window_pairing(trainer)
        return trainer

    def __init__(self, *args: Any, coupled_loss: CoupledLoss | None = None, **kwargs: Any) -> None:
        # Checked before the parent's `__init__` does any work.
        self.coupled_mode: CoupledWindowMode | None = None if coupled_loss is None else CoupledWindowMode(coupled_loss)
        super().__init__(*args, **kwargs)
        validate_gradaccum_fields(self.args)
        self._run_batch = RunBatchMode.for_trainer(self)
        if self.coupled_mode is not None and self.args.auto_find_batch_size:
            raise ValueError(
                "`auto_find_batch_size=True` cannot be used with `coupled_loss`: the out-of-memory retry splits a "
                "micro-batch into chunks, whose recomputed representations would draw other dropout masks than pass 1. "
                "Choose a micro-batch that fits (the window's representations are the only extra memory)."
            )
        self.moe_mode: MoEWindowMode | None = None
        moe_balance = gradaccum_option(self.args, "moe_load_balance")
        accumulates = self.args.gradient_accumulation_steps > 1 or self.args.world_size > 1
        if moe_balance == "window" or (moe_balance == "auto" and accumulates and adds_router_loss(self.model)):
            # A router's load-balancing loss is a statistic of the batch: per micro-batch it is another objective.
            require_first_in_class_order(type(self), "moe_load_balance='window'")
            self.moe_mode = window_router_mode(self.model, named=moe_balance == "window")
        # How the model's loss is normalised, settled on the first window (`adapters/loss_rule.py`).
        self._loss_rule = TrainerLossRule()
        require_private_names(self, CORE_PRIVATE_NAMES, "GradAccumTrainer")
        if gradaccum_option(self.args, "atomic_checkpoints"):
            require_private_names(self, ATOMIC_CHECKPOINT_PRIVATE_NAMES, "`atomic_checkpoints=True`")
        # Compositions the registry refuses stop here; one it does not know is checked on its first window.
        refuse_unaccumulable_losses(self)
        self._unknown_composition: str | None = None
        if self.args.gradient_accumulation_steps > 1 and gradaccum_option(self.args, "check_unknown_compositions"):
            self._unknown_composition = unknown_composed_trainer(self)
        # Items are counted on the inputs that reach `compute_loss` (`adapters/loss_counting.py`); the count made at
        # prefetch time is reused only where the parents hand the loss that very batch.
        self._count_at_prefetch = hands_batch_to_loss_unchanged(self)
        # A loss that divides by the `num_items_in_batch` it is handed (GKD): the count of the batch handed over.
        self._handed_count = divides_by_handed_count(self)
        if self._unknown_composition and not self._count_at_prefetch:
            # The first-window check splits the prefetched batch; these parents rebuild it before their loss.
            raise refuse_rebuilt_micro_batches(self, self._unknown_composition)
        # TRL's online RL and distillation trainers (GRPO, RLOO, GMPO, Distillation) generate inside `_prepare_inputs`:
        # their loss is counted per loss type on the micro-batch it receives (`adapters/trl_grpo.py`).
        # A*-PO, SDPO and Online DPO build their batch in the micro-step too (`adapters/trl_generating.py`).
        self._generation_accumulation: GenerationBatchAccumulation | Any | None = generation_accumulation_for(
            self
        ) or rebuilt_batch_accumulation_for(self)
        if getattr(self._generation_accumulation, "loss_inside_training_step", False):
            self._generation_accumulation.route_training_step(self, GradAccumTrainer)
        # A loss of two terms with different denominators (TRL's NLL or entropy term beside a preference term): each
        # term weighted by its own count over the window (`adapters/trl_loss_terms.py`).
        self._loss_terms: WindowTermWeights | None = window_term_weights_for(self)
        # DPO's `aot` losses sort the batch: sorted over the window (`adapters/trl_dpo_sorted.py`).
        self._sorted_loss: WindowSortedLoss | None = window_sorted_loss_for(self)
        # GRPO's `top_entropy_quantile < 1`: the window's quantile (`adapters/trl_grpo_entropy.py`).
        self._entropy_quantile: WindowEntropyQuantile | None = window_entropy_quantile_for(self)
        # TRL's KTOTrainer with a KL term: the window's baseline, shared by its micro-batches (`adapters/trl_kto.py`).
        self._kto_baseline: WindowKLBaseline | None = window_kl_baseline_for(self)
        check_trainer_engine(self)
        # DeepSpeed keeps the gradients itself: the window is made exact through the loss handed to its engine.
        self._deepspeed_window = DeepSpeedWindow(self) if deepspeed_enabled(self) else None
        if self._deepspeed_window is not None and (self._loss_terms or self._sorted_loss) is not None:
            what = (
                f"adds {self._loss_terms.term.term}, a mean over {self._loss_terms.term.items}, to a mean over "
                f"{self._loss_terms.term.primary}; the two terms need different micro-batch weights"
                if self._loss_terms is not None
                else f"sorts the batch ({self._sorted_loss.sorted_types}), which is answered from the window"
            )
            raise CompositionError(
                f"{type(self).__name__} under DeepSpeed: its loss {what}, set at the loss, which DeepSpeed's engine "
                "path does not reach. Stopped before any work. Fix: DDP or FSDP2, or `gradient_accumulation_steps=1`."
            )
        if self._deepspeed_window is not None and (not self._count_at_prefetch or self._handed_count):
            # DeepSpeed back-propagates a loss already weighted by its items: the count must exist before the loss.
            raise CompositionError(
                f"{type(self).__name__} under DeepSpeed: its parent classes rebuild the micro-batch before the loss "
                "(generation, slicing or collation) or divide by the count they are handed, so its items are known "
                "only at the loss, after the weight DeepSpeed's engine needs. Stopped before any work. Fix: DDP or "
                "FSDP2 (the accumulator counts at the loss there), or `gradient_accumulation_steps=1`."
            )
        # The model computes its own mean over its items, which the accumulator weights: `num_items_in_batch` must
        # not reach `forward` (most heads ignore it, some would divide by it), and the parent's `training_step` must
        # not divide the loss by the accumulation steps. `loss_is_scaled_for_ga` is the attribute transformers
        # documents for subclasses that scale their own loss; releases before 5.19 lack it, and there each
        # micro-batch is presented with `current_gradient_accumulation_steps` 1 instead (`_parent_training_step`).
        self.model_accepts_loss_kwargs = False
        self._present_one_step = not trainer_reads_loss_is_scaled_for_ga()
        if not self._present_one_step:
            self.loss_is_scaled_for_ga = True
        self._install_loss_handover()
        self.accumulator: GradientAccumulator | None = None
        self._window_items_local: float | None = None
        self._window_batches: list[dict[str, Any]] = []
        self._window_counts: dict[int, tuple[dict[str, Any], int]] = {}
        self._micro_index = 0
        self._window_log = WindowLossLog()
        # While the parent's training_step runs one micro-batch (the KTO baseline is substituted then).
        self._in_micro_step = False
        # The inputs the loss saw in the micro-step running now (an fp16 recompute replays them).
        self._seen_inputs: list[Any] = []
        self._resume_state_path: str | None = None
        self._training = False  # inside `train()`
        self._window_end = WindowEndAtClipping(self, GradAccumTrainer)
        # Effective-batch-preserving OOM retry inside `training_step` (`auto_find_batch_size=True`).
        self.oom_retry = WindowOOMRetry(shrink=self._shrink_chunk)
        self.add_callback(_LoopRestartCallback(self))
        if gradaccum_option(self.args, "take_back_skipped_steps"):
            self.add_callback(SkippedStepCallback(self._last_window_applied))
        effective_batch = EffectiveBatchCallback.from_args(self.args)
        if effective_batch is not None:
            self.add_callback(effective_batch)
            # The parent's `on_init_end` ran before this class's fields were read; the policy acts now, still before
            # the optimizer and scheduler are created.
            effective_batch.on_init_end(self.args, self.state, self.control, model=self.model)
        self._route_composed_losses()

    def use_coupled_loss(self, coupled_loss: CoupledLoss) -> None:
        """Train in the coupled-loss mode from now on (an in-model contrastive loss found on the first window), with
        the checks `coupled_loss=` gets at construction."""
        require_first_in_class_order(type(self), "an in-batch contrastive loss (coupled mode)")
        if self.args.auto_find_batch_size:
            raise ValueError(
                "`auto_find_batch_size=True` cannot train an in-batch contrastive loss exactly: the out-of-memory "
                "retry would recompute representations in chunks that draw other dropout masks. Choose a "
                "micro-batch that fits."
            )
        self.coupled_mode = CoupledWindowMode(coupled_loss)

    def _route_composed_losses(self) -> None:
        """Composed with a trainer whose losses couple the batch (sentence-transformers'), route them to a mode that
        accumulates them exactly; see `adapters/sentence_transformers.py`."""
        from .sentence_transformers import route_sentence_transformers  # imports this module

        route_sentence_transformers(self)

    def get_train_dataloader(self):
        """The stock training loader; with `effective_batch_size`, one whose batch sampler lays out the run's windows
        (`adapters/run_batch.py`)."""
        if self._run_batch is None:
            return super().get_train_dataloader()
        return self._run_batch.train_dataloader()

    # ------------------------------------------------------------------ accumulator
    def _last_window_applied(self) -> bool:
        result = None if self.accumulator is None else self.accumulator.last_result
        return result is None or result.applied

    def create_accumulator(self, model: nn.Module) -> GradientAccumulator:
        """Build the [`GradientAccumulator`] for `model` from `self.args` (override to customise)."""
        loss_scaler = None
        if self.args.fp16 or (self.args.bf16 and gradaccum_option(self.args, "bf16_loss_scaling")):
            loss_scaler = DynamicLossScaler(
                init_scale=gradaccum_option(self.args, "loss_scale_init"),
                growth_factor=gradaccum_option(self.args, "loss_scale_growth_factor"),
                backoff_factor=gradaccum_option(self.args, "loss_scale_backoff_factor"),
                growth_interval=gradaccum_option(self.args, "loss_scale_growth_interval"),
            )
        return GradientAccumulator(
            model,
            self.args.gradient_accumulation_steps,
            accumulation_dtype=gradaccum_option(self.args, "accumulation_dtype"),
            loss_scaler=loss_scaler,
            overflow_policy=gradaccum_option(self.args, "overflow_policy"),
            max_recompute_attempts=gradaccum_option(self.args, "max_recompute_attempts"),
            fsdp_reduce_schedule=gradaccum_option(self.args, "fsdp_reduce_schedule"),
            offload_accumulation_buffer=gradaccum_option(self.args, "offload_accumulation_buffer"),
            data_parallel_group=data_parallel_group(self),
            accumulation_path=self._accumulation_path(),
        )

    def _accumulation_path(self) -> str:
        """`accumulation_path`, where `"auto"` keeps the hook path for a parent `training_step` not known to hand its
        loss to `accelerator.backward` (the in-place path weights the loss there; hooks fold any backward)."""
        path = gradaccum_option(self.args, "accumulation_path")
        return "hooks" if path == "auto" and not training_step_passes_through(self) else path

    def _get_accumulator(self, model: nn.Module) -> GradientAccumulator:
        acc = self.accumulator
        if acc is not None and acc.micro_steps_in_window and self._accumulator_model is model:
            # Mid-window the parameters cannot have changed: walking `model.parameters()` for every micro-batch
            # costs more than a small model's forward.
            return acc
        self._accumulator_model = model
        params = [p for p in model.parameters() if p.requires_grad]
        if acc is None or [id(p) for p in acc.parameters] != [id(p) for p in params]:
            state = None if acc is None else acc.state_dict()
            if acc is not None:
                acc.remove_hooks()
            acc = self.accumulator = self.create_accumulator(model)
            if state is not None and state["window"] is None:
                # Same run, new parameter objects (e.g. re-wrapped model): keep counters and loss scale.
                acc.load_state_dict(state)
            elif state is None and self._resume_state_path is not None:
                self._load_accumulator_state(acc, self._resume_state_path)
        acc.gradient_accumulation_steps = self.args.gradient_accumulation_steps
        acc.sums_losses = self._loss_rule.sums_losses
        return acc

    # ------------------------------------------------------------------ items
    def count_micro_batch_items(self, inputs: dict[str, Any]) -> int:
        """
        Items that the loss of this micro-batch is a mean over. Override for losses that are not a mean over the
        non-`-100` labels (e.g. a custom `compute_loss` that averages over something else).
        """
        if self.coupled_mode is not None:
            return self.coupled_mode.coupled_loss.num_items_fn(inputs)
        return read_counts([self._items_on_device(inputs)])[0]

    def _items_on_device(self, inputs: dict[str, Any]) -> int | torch.Tensor:
        """The default [`count_micro_batch_items`], a count of labels left as a tensor beside them."""
        settled = self._loss_rule.items_on_device(inputs)
        if settled is not None:
            return settled
        label_name = self.label_names[0] if self.label_names else "labels"
        labels = inputs.get(label_name)
        if isinstance(labels, (list, tuple)):
            # A list of targets per row (detection): counted by the settled rule; until then, one item per row.
            return len(labels)
        if labels is None and inputs.get("shift_labels") is None:
            self._warn_once(
                "no_labels",
                "GradAccumTrainer: micro-batches carry no `%s`, so each is weighted by its number of rows. That is "
                "exact when the loss is a mean over rows (TRL's DPOTrainer and RewardTrainer: a mean over pairs) and "
                "wrong otherwise: override `count_micro_batch_items` to return what your loss divides by.",
                label_name,
            )
        # Only token-level labels (one per position) can be shifted; a causal-LM check is pointless for the others.
        token_level = labels is not None and (labels if torch.is_tensor(labels) else torch.as_tensor(labels)).dim() > 1
        shift = self._shifts_labels() if token_level else False
        return items_on_device(inputs, shift_labels=shift, label_name=label_name)

    def _count_window(self, batches: list[dict[str, Any]]) -> list[int]:
        """[`count_micro_batch_items`] of each micro-batch of a window. The default count reads the device once for
        the whole window (on a GPU, one wait instead of one per micro-batch); an override is called per batch."""
        if self.coupled_mode is not None or (
            type(self).count_micro_batch_items is not GradAccumTrainer.count_micro_batch_items
        ):
            return [self.count_micro_batch_items(batch) for batch in batches]
        return read_counts([self._items_on_device(batch) for batch in batches])

    def _micro_batch_items(self, batch: dict[str, Any]) -> int:
        """[`count_micro_batch_items`] of `batch`, as counted when its window was prefetched if it is that very
        object (the identity check keeps a batch a parent rebuilt, or a chunk after an OOM, from reusing it)."""
        cached = self._window_counts.get(id(batch))
        if cached is not None and cached[0] is batch:
            return cached[1]
        return self.count_micro_batch_items(batch)

    def _shifts_labels(self) -> bool:
        """Whether items are counted as a causal LM's loss sees them (`labels[..., 1:]`), decided once per model."""
        override = gradaccum_option(self.args, "count_shifted_labels")
        if override is not None:
            return override
        model = self.model
        cached = getattr(self, "_shift_decision", None)
        if cached is not None and cached[0] is model:
            return cached[1]
        # Sees through PEFT, torch.compile and DDP wrappers, and recognises causal LMs by their loss function or
        # registered class, not only by a "ForCausalLM" class name (GPT2LMHeadModel has none).
        shifts = loss_shifts_labels(model)
        if shifts is None:
            shifts = bool(getattr(self, "_loss_shifts_labels", False))
            self._warn_once(
                "unknown_shift",
                "GradAccumTrainer cannot tell whether %s's loss shifts its token labels (a causal LM never predicts "
                "position 0, so its mean divides by one item fewer per row). Counting them %s; if that is wrong the "
                "update is off (by about one item per row). Set `count_shifted_labels=True/False` in the arguments.",
                type(model).__name__,
                "shifted (labels[..., 1:])" if shifts else "unshifted",
            )
        self._shift_decision = (model, shifts)
        return shifts

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        warned = self.__dict__.setdefault("_gradaccum_warned", set())
        if key not in warned:
            warned.add(key)
            logger.warning(message, *args)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Prefetch one window (as the stock Trainer does) and count its local items for the logged loss. Composed
        with TRL's KTOTrainer (a loss with a KL term), also compute the window's KL baseline over all ranks."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        # Kept so that an out-of-memory error can redo the window from its first micro-batch.
        self._window_batches = batch_samples
        self._micro_index = 0
        self._window_items_local = None
        self._window_counts = {}
        # Before any count: the first window settles what the model's loss is normalised by (or stops).
        self._loss_rule.window_prefetched(self, batch_samples)
        counts = None
        if self._count_at_prefetch or self._handed_count:
            # (Elsewhere the loss sees another batch than the one prefetched: it is counted there, not here.)
            try:
                counts = self._count_window(batch_samples)
            except (ValueError, TypeError, AttributeError):
                counts = None
            if counts is not None:
                self._window_items_local = float(sum(counts))
                # Reused at each micro-step: counting again there would read the device once per micro-batch.
                self._window_counts = {id(b): (b, n) for b, n in zip(batch_samples, counts, strict=True)}
        self._window_log.start(self._window_items_local if self._count_at_prefetch else None)
        if self._loss_terms is not None:
            # Every rank, every window: the terms' counts are summed over ranks.
            prefetched = self._count_at_prefetch and counts is not None
            self._loss_terms.start_window(self, batch_samples if prefetched else None, counts if prefetched else None)
        if self._entropy_quantile is not None:
            self._entropy_quantile.start_window()
        if self._sorted_loss is not None and batch_samples:
            self._sorted_loss.window_prefetched(self, batch_samples)  # forward-only, this rank's window
        if self._deepspeed_window is not None:
            self._deepspeed_window.window_prefetched(self._window_items_local)  # all ranks' items: one all-reduce
        if batch_samples and self._kto_baseline is not None:
            self._kto_baseline.prepare(self, batch_samples)  # forward-only, over all ranks
        if batch_samples and self._unknown_composition and not getattr(self, "_accumulation_verified", False):
            check_trainer_window(self, batch_samples, refuse=self._refuse_unknown_composition)
        elif batch_samples and should_verify(self):
            self.verify_accumulation(batch_samples)
        if self.moe_mode is not None:
            self.moe_mode.window_prefetched(self, batch_samples)  # forward-only, over all ranks
        if self.coupled_mode is not None:
            self.coupled_mode.window_prefetched(batch_samples)
        # `None`: the model computes its own per-micro-batch mean, which the accumulator weights.
        return batch_samples, None

    def verify_accumulation(self, batches: list[dict[str, Any]]):
        """Split-invariance check of accumulation on `batches` (`verify_accumulation` option); see
        [`~hf_gradaccum.verification.verify_split_invariance`] (in the coupled-loss mode, its coupled form). Returns
        its result (`None` if the window is too small)."""
        if self.coupled_mode is not None:
            return self.coupled_mode.verify(self, batches)
        return check_trainer_window(self, batches)

    def _refuse_unknown_composition(self, finding: str) -> CompositionError:
        loss = getattr(self.args, "loss_type", None) or getattr(self, "loss", None) or "its compute_loss"
        return CompositionError(
            f"GradAccumTrainer does not know how {self._unknown_composition} (loss: {loss!r}) accumulates, and the "
            "split-invariance check on the first window did not show it exact, so training may not equal the large "
            f"batch. Stopped before the first optimizer step.\n{finding}\nFix: `gradient_accumulation_steps=1` with the batch you "
            "want, or `register_composition` with how this loss accumulates (hf_gradaccum/adapters/compositions.py); "
            "`check_unknown_compositions=False` trains without the check."
        )

    # ------------------------------------------------------------------ the micro-step
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """
        Forward and item-weighted backward of one micro-batch through the accumulator. On the last micro-batch of a
        window (`self.accelerator.sync_gradients`), the large-batch mean gradient is written into `.grad`. Works
        outside `train()` too (then each call is a window of its own).

        Returns the micro-batch's share of the window's mean loss (the Trainer sums these for logging).
        """
        if self._deepspeed_window is not None:
            return self._deepspeed_step(model, inputs)
        if self.coupled_mode is not None:
            return self.coupled_mode.training_step(self, model, inputs, lambda: self._accumulated_step(model, inputs))
        return self._accumulated_step(model, inputs)

    def _deepspeed_step(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """One micro-batch under DeepSpeed: the parents' own `training_step`, its loss weighted on the way to
        DeepSpeed's engine. Returns the micro-batch's share of the window's mean loss, as `_accumulated_step`."""
        items = self._micro_batch_items(inputs)

        def parent_step() -> torch.Tensor:
            steps = getattr(self, "current_gradient_accumulation_steps", None)
            if self._present_one_step:
                self.current_gradient_accumulation_steps = 1
            try:
                return super(GradAccumTrainer, self).training_step(model, inputs, None)
            finally:
                if self._present_one_step:
                    if steps is None:
                        del self.current_gradient_accumulation_steps
                    else:
                        self.current_gradient_accumulation_steps = steps

        loss = self._deepspeed_window.training_step(items, parent_step)
        return loss * (items / self._window_items_local) if self._window_items_local else loss * 0.0

    def _accumulated_step(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        accumulator = self._get_accumulator(model)
        # A window left for clipping that the loop neither clipped nor stepped on ends now, before the next one.
        self._window_end.finish(None)
        if self._micro_index >= len(self._window_batches) or self._window_batches[self._micro_index] is not inputs:
            if accumulator.micro_steps_in_window:
                # A parent passed its own copy of the micro-batch: keep it for an out-of-memory redo of the window.
                self._window_batches = [*self._window_batches[: self._micro_index], inputs]
            else:
                # Called outside the Trainer's loop: a window of its own.
                self._window_batches, self._micro_index, self._window_items_local = [inputs], 0, None
                self._window_counts = {}
                self._window_log.start(None)
        micro_index = self._micro_index
        self._micro_index += 1

        def micro_step(batch: dict[str, Any]):
            return self._accumulate(model, accumulator, batch)

        if self.args.auto_find_batch_size:
            loss, num_items = self.oom_retry.run(accumulator, self._window_batches, micro_index, micro_step)
        else:
            loss, num_items = micro_step(inputs)

        # Outside `train()` each call is a window of its own: Accelerate's `sync_gradients` is process-wide state that
        # an interrupted `train()` can leave False.
        last = self.accelerator.sync_gradients or not self._training
        if last and not self._window_end.defer(accumulator):
            self.on_window_end(accumulator.finish_window())

        if self._loss_rule.sums_losses:
            return loss  # already its share of the window's loss
        if not self._training:
            if self._window_items_local:
                return loss * (num_items / self._window_items_local)
            return loss / getattr(self, "current_gradient_accumulation_steps", 1)
        cached = self._window_counts.get(id(inputs))
        prefetched = cached[1] if cached is not None and cached[0] is inputs else None
        steps = getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps
        return self._window_log.share(loss, num_items, prefetched, last=last, steps=steps)

    def _accumulate(self, model: nn.Module, accumulator: GradientAccumulator, inputs: dict[str, Any]):
        """Forward + weighted backward of one micro-batch (in chunks after an OOM). Returns (mean loss, items)."""
        loss_sum, total_items = None, 0
        for chunk in self.oom_retry.chunks(inputs):
            # The count made at prefetch time where the loss sees that very batch (else it is counted at the loss),
            # and for a loss that divides by what it is handed, the count of the batch handed over.
            counted = self._micro_batch_items(chunk) if self._count_at_prefetch or self._handed_count else None
            share = handed_window_share(self) if counted is not None and self._handed_count else 1
            if share > 1:
                # GOLD and IW-OPD are handed the whole window at every micro-step: each slice takes an equal share.
                counted = counted / share
            loss, num_items = self._parent_training_step(model, accumulator, chunk, counted)
            weighted = loss.float() * num_items if num_items else torch.zeros((), device=loss.device)
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            total_items += num_items
        return (loss_sum / total_items if total_items else loss_sum), total_items

    def _parent_training_step(
        self, model: nn.Module, accumulator: GradientAccumulator, inputs: Any, num_items: int | None
    ) -> tuple[torch.Tensor, float]:
        """
        One micro-batch through the parent classes' own `training_step`, unpatched (TRL's activation-offloading
        context, any context a subclass adds, then `Trainer.training_step`'s `_prepare_inputs`, forward,
        `compute_loss` and `accelerator.backward`, each once), between the accumulator's `begin_micro_batch` and
        `end_micro_batch`: its hooks fold the gradients of that backward, weighted by the micro-batch's items.
        Where the loss itself must change first (fp16 loss scaling; FSDP2, whose reduce-scatter sums the ranks'
        gradients before the fold), Accelerate hands it to the scaler this class installs, which asks the
        accumulator. After an fp16 overflow only this micro-batch's `compute_loss` and backward run again. The items
        are counted on the inputs that reach `compute_loss` (`adapters/loss_counting.py`): `num_items` is the count
        made at prefetch time, used where the loss provably sees that batch. Returns the micro-batch's detached mean
        loss and its items.

        The parent's `compute_loss` returns the micro-batch's own mean loss, which the accumulator weights by its
        share of the window's items: it gets no `num_items_in_batch` (so the model, a label smoother and TRL's
        SFTTrainer take the micro-batch's own mean), except a `compute_loss_func`, which divides by what it is given
        ([`_num_items_for_parent`]).
        """
        parent_items = self._num_items_for_parent(num_items)
        counted: list[float] = []
        handed_over = [0]

        def begin(items: float) -> None:
            if not counted:  # an fp16 recompute presents the same micro-batch again
                counted.append(items)
                accumulator.begin_micro_batch(items, can_recompute=True)

        def hand_over(loss: torch.Tensor) -> torch.Tensor:
            handed_over[0] += 1
            return accumulator.loss_to_backward(loss)

        rule = self._generation_accumulation

        def count_and_present(loss_inputs: Any) -> tuple[float, Callable[[], None]]:
            if rule is not None:
                return rule.present(self, loss_inputs)
            if num_items is not None:
                return num_items, lambda: None
            if counted:  # recomputed after an fp16 overflow: the same inputs, already counted
                return counted[0], lambda: None
            return self.count_micro_batch_items(loss_inputs), lambda: None

        def present(loss_inputs: Any) -> tuple[float, Callable[[], None]]:
            items, restore = count_and_present(loss_inputs)
            if not self._training:
                return items, restore
            restores = [restore]

            def restore_all() -> None:
                for undo in reversed(restores):
                    undo()

            try:
                if self._entropy_quantile is not None:
                    # First: the window's threshold also says how many tokens an entropy bonus is a mean over.
                    restores.append(self._entropy_quantile.present(self))
                if self._loss_terms is not None:
                    restores.append(self._loss_terms.scale(self, loss_inputs, items))
                if self._sorted_loss is not None:
                    # (The batch the loop handed over: the loss's own inputs are its copy on the device.)
                    restores.append(self._sorted_loss.present(self, inputs))
            except BaseException:
                restore_all()  # nothing the loss would have seen stays installed
                raise
            return items, restore_all

        def items_for_loss(items: float) -> torch.Tensor | None:
            return parent_items if self._handed_count else self._num_items_for_parent(items)

        if self._handed_count:
            parent_items = self._num_items_for_parent(num_items, handed=True)
        self._hand_over = hand_over
        # transformers < 5.19 only: its `training_step` divides by this value unless a `compute_loss_func` is set.
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        if self._present_one_step:
            self.current_gradient_accumulation_steps = 1
        self._install_loss_handover(accumulator)
        # The in-place path weights the loss itself; without a `WindowGradScaler` to hand it over, the Accelerator's
        # `backward` does, for this micro-batch only.
        handover = (
            backward_through(self.accelerator, hand_over)
            if accumulator.in_place and not isinstance(self.accelerator.scaler, WindowGradScaler)
            else contextlib.nullcontext()
        )
        try:
            # No DDP all-reduce for any micro-batch (the last one included): the accumulator reduces its flat
            # buffer once per window.
            self._in_micro_step = True
            with (
                accumulator.accumulate(model),
                handover,
                counting_at_the_loss(self, present, begin, items_for_loss) as seen,
            ):
                self._seen_inputs = seen
                if getattr(rule, "loss_inside_training_step", False):
                    # Online DPO computes and back-propagates its loss without `compute_loss`: counted as handed.
                    begin(rule.count_handed(inputs))
                    loss = rule.returned_loss(self, rule.parent_step(self, model, inputs, parent_items))
                else:
                    loss = super().training_step(model, inputs, parent_items)
                self._check_micro_batch_ran(accumulator, counted, handed_over[0])
                while accumulator.end_micro_batch(loss):
                    loss = self._recompute_micro_batch(model, inputs, parent_items)
        finally:
            self._in_micro_step = False
            self._hand_over = None
            self._seen_inputs = []
            if self._present_one_step:
                if steps is None:
                    del self.current_gradient_accumulation_steps
                else:
                    self.current_gradient_accumulation_steps = steps
        return loss, counted[0]

    def _num_items_for_parent(self, num_items: float | None, handed: bool = False) -> torch.Tensor | None:
        """
        `num_items_in_batch` for the parent's `training_step`: `None`, so that each loss is its micro-batch's own
        mean. A `compute_loss_func` (or, with `handed=True`, a trainer's loss that divides by the count it is handed)
        divides by what it is given, so it gets the micro-batch's own count; with `average_tokens_across_devices` on,
        the Trainer multiplies the loss by the number of processes (it takes the count to span every rank, as its own
        does), so the count is handed over as every rank's.
        """
        # TRL (transformers < 5.19) stores a non-callable marker here to switch the Trainer's division off.
        if num_items is None or not (handed or callable(self.compute_loss_func)):
            return None
        ranks = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
        return torch.tensor(num_items * ranks, device=self.args.device)

    def _check_micro_batch_ran(self, accumulator: GradientAccumulator, counted: list[float], handed_over: int) -> None:
        """Refuse, before anything is folded into a step, a parent `training_step` that did not run one micro-batch as
        `Trainer.training_step` does: the weighting would silently be wrong."""
        if not counted:
            raise RuntimeError(
                f"{type(self).__name__}: the parent classes' `training_step` returned without calling `compute_loss`, "
                "so GradAccumTrainer could not count the items of the micro-batch its loss saw."
            )
        micro = accumulator.current_micro_batch
        if handed_over > 1:
            raise RuntimeError(
                f"{type(self).__name__}.training_step called `accelerator.backward` twice for one micro-batch; "
                "GradAccumTrainer can weight only one loss per micro-batch. Return the sum from `compute_loss`."
            )
        # A backward of the loss as it is suffices where the accumulator would not change it (fp32, replicated
        # buffers); under fp16 loss scaling or FSDP2 it must pass through `accelerator.backward`.
        if not handed_over and not (micro.gradients_arrived and accumulator.loss_factor_is_one):
            raise RuntimeError(
                f"The training_step of {type(self).__name__}'s parent classes returned without calling "
                "`self.accelerator.backward(loss)`, so GradAccumTrainer could not weight and accumulate the "
                "gradient (under fp16 loss scaling or FSDP2 the loss must be handed to the Accelerator). Compose "
                "GradAccumTrainer only with trainers whose training_step ends in `Trainer.training_step` "
                "(SFTTrainer, DPOTrainer, RewardTrainer, Seq2SeqTrainer do)."
            )

    def _recompute_micro_batch(self, model: nn.Module, inputs: Any, items: torch.Tensor | None) -> torch.Tensor:
        """
        fp16 overflow: this micro-batch's forward and backward again, at the backed-off scale, on the micro-batch its
        first forward saw (a generation batch's buffered completions, not new ones), through the public
        `compute_loss` and `accelerator.backward`. Returns the detached loss.
        """
        # The inputs the first forward's loss saw (a generation batch's buffered completions, not new ones); the
        # counting `compute_loss` still installed presents them again.
        again_inputs = self._seen_inputs[0] if self._seen_inputs else self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, again_inputs, num_items_in_batch=items)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        self.accelerator.backward(loss)
        return loss.detach()

    def _install_loss_handover(self, accumulator: GradientAccumulator | None = None) -> None:
        """
        Install `WindowGradScaler` where it is needed: Accelerate back-propagates `scaler.scale(loss)`, so it is where
        the accumulator changes a loss before its backward (fp16 loss scaling; FSDP2's item weight), and its `step`
        reports a skipped window's optimizer step as skipped (loss scaling; `take_back_skipped_steps`), as a stock
        GradScaler does after an overflow. Otherwise (fp32, replicated buffers) the Accelerator keeps no scaler, as
        in the stock Trainer: the parent's backward of its own loss is what the accumulator folds. Installed again if
        the Accelerator was re-created (a hyperparameter search does).
        """
        # Asked at every micro-batch: decided once per (Accelerator, accumulator), since the answer reads every
        # parameter (`trainer_shards_gradients`).
        decided = self._handover_decided
        if decided is not None and decided[0] is self.accelerator and decided[1] is accumulator:
            return
        self._handover_decided = (self.accelerator, accumulator)
        loss_scaling = self.args.fp16 or (self.args.bf16 and gradaccum_option(self.args, "bf16_loss_scaling"))
        # At construction, before any checkpoint is resumed: the Trainer saves and loads `scaler.pt` when the
        # Accelerator has a scaler, so it must be there from the start whenever it is there at all.
        needed = (
            loss_scaling
            or gradaccum_option(self.args, "take_back_skipped_steps")
            or trainer_shards_gradients(self)
            or (accumulator is not None and not accumulator.loss_factor_is_one and not accumulator.in_place)
        )
        if not needed or self._deepspeed_window is not None or isinstance(self.accelerator.scaler, WindowGradScaler):
            return
        if self.accelerator.gradient_accumulation_steps != 1:
            # Accelerate would divide each loss by its own steps before handing it over.
            raise RuntimeError(
                "GradAccumTrainer needs the Trainer's Accelerator at `gradient_accumulation_steps=1` (the Trainer "
                f"creates it so), got {self.accelerator.gradient_accumulation_steps}."
            )
        # Disabled: the accumulator owns loss scaling (per window, unscaled into the fp32 buffers); Accelerate's
        # autocast stays and its unscale calls are no-ops.
        self.accelerator.scaler = WindowGradScaler(
            self.accelerator.device.type,
            should_skip=self._optimizer_step_must_be_skipped,
            hand_over=self._loss_to_backward,
        )

    def _loss_to_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """What Accelerate back-propagates: inside a micro-batch, the accumulator's tensor for its loss; any other
        backward (a user's own, outside `training_step`) the loss unchanged."""
        return loss if self._hand_over is None else self._hand_over(loss)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The parents' `compute_loss`; in the coupled-loss mode the micro-batch's pass-2 surrogate (outside training,
        the coupled loss of the batch), in the MoE window mode with the window's exact router term."""
        coupled = self.coupled_mode
        if coupled is not None and (coupled.in_pass_two or coupled.owns_loss):
            return coupled.compute_loss(model, inputs, return_outputs)
        if self.moe_mode is not None and model.training:
            return self.moe_mode.compute_loss(
                self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch
            )
        terms = self._loss_rule.terms
        if terms is not None and self._in_micro_step:
            # The micro-batch's share of the window's loss, each term divided by its own window count.
            _, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            loss = terms.micro_batch_loss(outputs, inputs)
            return (loss, outputs) if return_outputs else loss
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """
        The parent's context around `compute_loss`. For a composed KTOTrainer, the loss uses the window's KL baseline
        instead of the micro-batch's own for its length (`adapters/trl_kto.py`).
        """
        stack = super().compute_loss_context_manager()
        baseline = getattr(self, "_kto_baseline", None)
        if baseline is not None and getattr(self, "_in_micro_step", False):
            stack.enter_context(baseline.substituted(self))
        return stack

    # ------------------------------------------------------------------ out-of-memory retry (auto_find_batch_size)
    @property
    def micro_batch_chunk_size(self) -> int | None:
        """Rows per forward/backward after out-of-memory shrinking; `None` until the first OOM."""
        return self.oom_retry.chunk_size

    def _shrink_chunk(self, current: int) -> int:
        """Halve the micro-batch as [`AccumulationPlan.halved`] does (keeps the effective batch exactly)."""
        micro = self.oom_retry.chunk_size or self._train_batch_size
        if self._run_batch is not None:
            plan = self._run_batch.halved(micro)
        else:
            steps = self.args.gradient_accumulation_steps * max(1, self._train_batch_size // micro)
            plan = AccumulationPlan(micro, steps, self.args.world_size, micro * steps * self.args.world_size).halved()
        self.accumulation_plan = plan
        logger.warning(
            "Out of memory: micro-batch now %d x %d accumulation steps (effective batch %d unchanged); redoing "
            "the interrupted window from its first micro-batch.",
            plan.micro_batch_size,
            plan.gradient_accumulation_steps,
            plan.effective_batch_size,
        )
        self.log(
            {
                "oom/micro_batch_size": float(plan.micro_batch_size),
                "oom/gradient_accumulation_steps": float(plan.gradient_accumulation_steps),
            }
        )
        return plan.micro_batch_size

    def _restart_after_oom(self) -> None:
        """`on_train_begin`: the stock `find_executable_batch_size` restarted the loop (an OOM outside
        `training_step`) at a smaller `per_device_train_batch_size`: drop the interrupted window and the old chunking."""
        self.oom_retry.reset()
        self._window_end.discard()
        self._window_batches, self._micro_index, self._window_counts = [], 0, {}
        if self.accumulator is not None and self.accumulator.micro_steps_in_window:
            self.accumulator.discard_window()

    def on_window_end(self, result: WindowResult) -> None:
        """Called with each window's [`WindowResult`] before the optimizer step (override to inspect): before the
        Trainer's clipping, or, where the window ends inside it, with the norm before clipping in `grad_norm`."""
        if not result.applied:
            logger.warning(
                "Window skipped (%s) at global step %d: its update is not applied (weights and optimizer state are "
                "left untouched).",
                result.skip_reason,
                self.state.global_step,
            )

    # ------------------------------------------------------------------ clipping
    def _clip_grad_norm(self, model: nn.Module):
        norm = self._window_end.finish_for_clipping(self.args.max_grad_norm)
        return super()._clip_grad_norm(model) if norm is None else norm

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        if grad_norm is None:
            grad_norm = self._window_end.finish_for_clipping(math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _optimizer_step_must_be_skipped(self) -> bool:
        """Whether Accelerate should report the coming optimizer step as skipped (the scheduler then does not step):
        after a skipped window under loss scaling (as a stock fp16 overflow), or always with `take_back_skipped_steps`."""
        acc = self.accumulator
        if acc is None or acc.last_result is None or acc.last_result.applied:
            return False
        return acc.loss_scaler is not None or bool(gradaccum_option(self.args, "take_back_skipped_steps"))

    # ------------------------------------------------------------------ mixed precision
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """
        Accelerate autocasts the forward pass when it supports the device; it does not for fp16 on CPU, so the
        fp16 path (autocast + this project's loss scaling) is switched on here instead of silently training in fp32.
        """
        if self.args.fp16 and not self.accelerator.native_amp:
            return torch.autocast(device_type=self.args.device.type, dtype=torch.float16, cache_enabled=cache_enabled)
        return super().autocast_smart_context_manager(cache_enabled)

    # ------------------------------------------------------------------ resume and checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """[`~transformers.Trainer.train`], unchanged; it also restores the accumulator's state (loss scale,
        counters) from the checkpoint it resumes from."""
        path = resume_from_checkpoint
        if path is True:
            # The parent resolves `True` itself (and raises "No valid checkpoint found" when there is none).
            path = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        state_file = os.path.join(path, ACCUMULATOR_STATE_NAME) if isinstance(path, str) else None
        self._resume_state_path = state_file if state_file and os.path.isfile(state_file) else None
        if self._resume_state_path and self._run_batch is not None:
            saved = torch.load(self._resume_state_path, weights_only=False).get("run_batch")
            self._run_batch.check_resume(saved, path)
        if self._resume_state_path and self.accumulator is not None:
            self._load_accumulator_state(self.accumulator, self._resume_state_path)
        self._training = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            # A refusal (or any error) inside a window leaves Accelerate's process-wide `sync_gradients` False, which
            # the next trainer in this process would read as "mid-window".
            gradient_state = getattr(self.accelerator, "gradient_state", None)
            if hasattr(gradient_state, "_set_sync_gradients"):
                gradient_state._set_sync_gradients(True)
            raise
        finally:
            self._training = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        # `_save_checkpoint` saves the model through here; the accumulator's state goes next to it.
        if _internal_call and output_dir is not None and self.accumulator is not None and self.args.should_save:
            state = {
                "accumulator": self.accumulator.state_dict(),
                "effective_batch_size": self._effective_batch_size(),
                "micro_batch_size": self._train_batch_size,
                "micro_batch_chunk_size": self.micro_batch_chunk_size,
                "run_batch": None if self._run_batch is None else self._run_batch.state(),
            }
            # Under FSDP2 with sharded state dicts, `save_model` writes nothing itself (Accelerate's DCP files come
            # later, with the optimizer), so the directory may not exist yet.
            os.makedirs(output_dir, exist_ok=True)
            tmp = os.path.join(output_dir, ACCUMULATOR_STATE_NAME + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(output_dir, ACCUMULATOR_STATE_NAME))  # never a half-written file

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Stock unless `atomic_checkpoints=True` (opt-in; see `adapters/atomic_checkpoints.py` for why it needs this).
        if not gradaccum_option(self.args, "atomic_checkpoints"):
            return super()._save_checkpoint(model, trial)
        save_checkpoint_atomically(self, lambda: super(GradAccumTrainer, self)._save_checkpoint(model, trial), trial)

    def _effective_batch_size(self) -> int:
        args = self.args
        if self._run_batch is not None:
            return self._run_batch.effective_batch_size
        return effective_batch_size(
            args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
        )

    def _load_accumulator_state(self, acc: GradientAccumulator, path: str) -> None:
        state = torch.load(path, weights_only=False)
        saved, now = state["effective_batch_size"], self._effective_batch_size()
        if saved != now:
            message = (
                f"Resuming from {os.path.dirname(path)}, trained with an effective batch of {saved} (micro-batch x "
                f"gradient_accumulation_steps x world_size); this run uses {now}."
            )
            if gradaccum_option(self.args, "refuse_resume_with_different_batch"):
                raise ValueError(message + " Resume with the same effective batch, or start a new run.")
            logger.warning(message)
        accumulator_state = dict(state["accumulator"])
        if accumulator_state.get("window") is not None:
            # Trainer checkpoints are written at optimizer-step boundaries, so this comes from a plain-loop save:
            # its half-accumulated window belongs to data this run will not replay.
            logger.warning("The checkpoint holds a partly accumulated window; it is discarded.")
            accumulator_state["window"] = None
        if accumulator_state.get("loss_scaler") is not None and acc.loss_scaler is None:
            accumulator_state["loss_scaler"] = None  # resumed without fp16: the loss scale is not needed
        accumulator_state["gradient_accumulation_steps"] = acc.gradient_accumulation_steps
        acc.load_state_dict(accumulator_state)
        if state.get("micro_batch_size") in (None, self._train_batch_size):
            self.oom_retry.chunk_size = state.get("micro_batch_chunk_size")
        logger.info("Restored accumulator state from %s: %s", path, acc.metrics())

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.accumulator is not None and ("loss" in logs or "train_loss" in logs):
            # In place, as `Trainer.log` adds `epoch` in place: callers (e.g. `train()` building
            # `train_results.json`) see every key the stock Trainer would give them, plus ours.
            logs.update(self.accumulator.metrics())
        super().log(logs, start_time)


def require_first_in_class_order(trainer_cls: type, option: str) -> None:
    """A mode that replaces the loss must see `compute_loss` before a composed trainer does: raise a `ValueError`
    naming `option` and the class order to use when another trainer's `compute_loss` comes first."""
    for cls in trainer_cls.__mro__:
        if cls is GradAccumTrainer:
            return
        if not issubclass(cls, GradAccumTrainer) and "compute_loss" in vars(cls):
            raise ValueError(
                f"{option} needs GradAccumTrainer before {cls.__name__} in the class order (its `compute_loss` would "
                f"run first): `class {trainer_cls.__name__}(GradAccumTrainer, {cls.__name__})`."
            )


class _LoopRestartCallback(TrainerCallback):
    """`on_train_begin` runs again when the stock `auto_find_batch_size` restarts the loop at a smaller batch."""

    def __init__(self, trainer: GradAccumTrainer) -> None:
        self._trainer = trainer
        self._batch_size: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        batch_size = self._trainer._train_batch_size
        if self._batch_size is not None and batch_size != self._batch_size:
            self._trainer._restart_after_oom()
        self._batch_size = batch_size
        return control
