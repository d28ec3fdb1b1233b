"""`GradAccumTrainer`: a `transformers.Trainer` whose gradient accumulation is exactly the large-batch update.

A thin adapter: the accumulation itself lives in the engine ([`GradientAccumulator`]), which plain loops use directly,
and every step of a micro-batch in the modules beside this one. The Trainer's own loop is left alone; with every option
at its default, a run behaves as the stock `Trainer` in everything but the gradient it steps with
(docs/trainer_fidelity.md lists the differences). Public methods overridden, in the order a window meets them:

- `get_train_dataloader`: with `effective_batch_size`, the stock loader on the run's windows (`distributed/run_batch.py`);
- `get_batch_samples`: prefetch the window as the stock loop does, settle the loss rule on the first window
  (`losses/rule.py`), count its items, and start what the window's loss needs (KTO's baseline, DPO's sort, the
  coupled and MoE window modes: `integrations/registry.py`, `losses/coupled.py`, `losses/moe.py`);
- `training_step`: each micro-batch through the parents' own `training_step` (`trainer/micro_batch.py`); under
  DeepSpeed the loss handed to its engine is weighted instead (`distributed/deepspeed.py`); with
  `auto_find_batch_size=True` an out-of-memory error shrinks the micro-batch and redoes the window
  (`trainer/out_of_memory.py`); on the window's last micro-batch, the large-batch mean gradient goes into `.grad`, or
  the window ends inside the clipping (`trainer/window_end.py`); a user's override around it is followed one loop
  call, one micro-batch, at a time (`trainer/loop_calls.py`);
- `compute_loss`: the parents' own, except in the coupled-loss mode, the MoE window mode and a loss of several terms;
- `_clip_grad_norm` / `_get_grad_norm` (private, guarded): end a window left to the clipping;
- `log`: add the accumulator's counters (`accumulator/*` keys);
- `train` / `save_model`: the accumulator's state in every checkpoint and back on resume (`trainer/accumulator_state.py`).
Opt-in policies are callbacks the fields add (`trainer/step_gating.py`, [`EffectiveBatchCallback`]).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..config.arguments import gradaccum_option, validate_gradaccum_fields
from ..config.compat import (
    ATOMIC_CHECKPOINT_PRIVATE_NAMES,
    CORE_PRIVATE_NAMES,
    require_private_names,
    trainer_reads_loss_is_scaled_for_ga,
)
from ..distributed.deepspeed import DeepSpeedWindow, deepspeed_enabled
from ..distributed.parallelism import data_parallel_group
from ..distributed.run_batch import RunBatchMode
from ..distributed.sharding import check_trainer_engine
from ..engine.accumulator import GradientAccumulator, WindowResult
from ..engine.items import read_counts
from ..engine.loss_scaling import DynamicLossScaler
from ..engine.oom_retry import WindowOOMRetry
from ..engine.window_losses.coupled import CoupledLoss
from ..integrations.registry import (
    attach_composed_losses,
    handed_window_share,
    install_window_pairing,
    refuse_under_deepspeed,
    route_sentence_transformers,
)
from ..losses.accumulation_check import check_trainer_window
from ..losses.counting import WindowLossLog, training_step_passes_through
from ..losses.coupled import CoupledWindowMode
from ..losses.moe import MoEWindowMode, adds_router_loss, window_router_mode
from ..losses.rule import TrainerLossRule, hands_stock_items
from ..losses.trainer_probe import stock_num_items
from .accumulator_state import load_accumulator_state, resume_state_path, save_accumulator_state
from .atomic_checkpoints import save_checkpoint_atomically
from .class_order import require_first_in_class_order
from .effective_batch import EffectiveBatchCallback
from .item_counting import count_prefetched_window, labels_on_device, shifts_labels
from .loop_calls import CountedSteps, LoopCalls
from .loss_handover import install_window_scaler
from .micro_batch import MicroBatchRun, presented_as_one_step
from .out_of_memory import LoopRestartCallback, shrink_micro_batch
from .step_gating import SkippedStepCallback
from .window_end import WindowEndAtClipping
from .window_start import place_in_window, start_window

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
    # Set while one micro-batch runs: where the installed scaler hands the loss (`trainer/micro_batch.py`).
    _hand_over: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Under DeepSpeed: the weight of each micro-batch's loss handed to its engine (`distributed/deepspeed.py`).
    _deepspeed_window: DeepSpeedWindow | None = None
    # What `_get_accumulator` and `_install_loss_handover` decided last (asked at every micro-batch).
    _accumulator_model: nn.Module | None = None
    _handover_decided: tuple[Any, GradientAccumulator | None] | None = None
    # `effective_batch_size`: this class's `get_train_dataloader` builds the run's windows (`distributed/run_batch.py`).
    _honours_run_batch = True
    _run_batch: RunBatchMode | None = None
    # The window's `num_items_in_batch` as the stock Trainer counts it, for a user's `compute_loss`.
    _stock_num_items: torch.Tensor | int | None = None
    # During `train()`, where a user's class wraps `training_step`: the loop's calls, one micro-batch each.
    _loop_calls: LoopCalls | None = None
    current_gradient_accumulation_steps = CountedSteps()

    def __new__(cls, *args: Any, **kwargs: Any) -> GradAccumTrainer:
        if kwargs.get("coupled_loss") is not None:
            require_first_in_class_order(cls, "`coupled_loss`", GradAccumTrainer)
        trainer = super().__new__(cls)
        # TRL's KTOTrainer builds its KL pairs while preparing its datasets, in its own `__init__`, which runs before
        # this class's when it comes first in the class order: they are made the large batch's here
        # (`integrations/trl/kto.py`).
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
            require_first_in_class_order(type(self), "moe_load_balance='window'", GradAccumTrainer)
            self.moe_mode = window_router_mode(self.model, named=moe_balance == "window")
        # How the model's loss is normalised, settled on the first window (`losses/rule.py`).
        self._loss_rule = TrainerLossRule()
        require_private_names(self, CORE_PRIVATE_NAMES, "GradAccumTrainer")
        if gradaccum_option(self.args, "atomic_checkpoints"):
            require_private_names(self, ATOMIC_CHECKPOINT_PRIVATE_NAMES, "`atomic_checkpoints=True`")
        # What the composed library trainer's loss needs beyond item weighting (`integrations/registry.py`).
        attach_composed_losses(self, GradAccumTrainer)
        check_trainer_engine(self)
        # DeepSpeed keeps the gradients itself: the window is made exact through the loss handed to its engine.
        self._deepspeed_window = DeepSpeedWindow(self) if deepspeed_enabled(self) else None
        if self._deepspeed_window is not None:
            refuse_under_deepspeed(self)
        # The model computes its own mean over its items, which the accumulator weights: `num_items_in_batch` must
        # not reach `forward` (most heads ignore it, some would divide by it), and the parent's `training_step` must
        # not divide the loss by the accumulation steps. `loss_is_scaled_for_ga` is the attribute transformers
        # documents for subclasses that scale their own loss; releases before 5.19 lack it, and there each
        # micro-batch is presented with `current_gradient_accumulation_steps` 1 instead (`presented_as_one_step`).
        # The stock Trainer's view still decides the `num_items_in_batch` a user's `compute_loss` is handed.
        self._stock_accepts_loss_kwargs = self.model_accepts_loss_kwargs
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
        self.oom_retry = WindowOOMRetry(shrink=functools.partial(shrink_micro_batch, self))
        self.add_callback(LoopRestartCallback(self))
        if gradaccum_option(self.args, "take_back_skipped_steps"):
            self.add_callback(SkippedStepCallback(self._last_window_applied))
        effective_batch = EffectiveBatchCallback.from_args(self.args)
        if effective_batch is not None:
            self.add_callback(effective_batch)
            # The parent's `on_init_end` ran before this class's fields were read; the policy acts now, still before
            # the optimizer and scheduler are created.
            effective_batch.on_init_end(self.args, self.state, self.control, model=self.model)
        # Composed with sentence-transformers' trainers, whose losses couple the batch: routed to a mode that
        # accumulates them exactly (`integrations/sentence_transformers/routing.py`).
        route_sentence_transformers(self)

    def use_coupled_loss(self, coupled_loss: CoupledLoss) -> None:
        """Train in the coupled-loss mode from now on (an in-model contrastive loss found on the first window), with
        the checks `coupled_loss=` gets at construction."""
        require_first_in_class_order(type(self), "an in-batch contrastive loss (coupled mode)", GradAccumTrainer)
        if self.args.auto_find_batch_size:
            raise ValueError(
                "`auto_find_batch_size=True` cannot train an in-batch contrastive loss exactly: the out-of-memory "
                "retry would recompute representations in chunks that draw other dropout masks. Choose a "
                "micro-batch that fits."
            )
        self.coupled_mode = CoupledWindowMode(coupled_loss)

    def get_train_dataloader(self):
        """The stock training loader; with `effective_batch_size`, one whose batch sampler lays out the run's windows
        (`distributed/run_batch.py`)."""
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
                load_accumulator_state(self, acc, self._resume_state_path)
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

    def _declared_items(self, inputs: dict[str, Any]) -> int | float:
        """[`count_micro_batch_items`] of `inputs`; 1 where it declares terms (a dict: `mean_terms` returns shares)."""
        items = self.count_micro_batch_items(inputs)
        return 1 if isinstance(items, Mapping) else items

    def _items_on_device(self, inputs: dict[str, Any]) -> int | torch.Tensor:
        """The default [`count_micro_batch_items`], a count of labels left as a tensor beside them."""
        return labels_on_device(self, inputs)

    def _count_window(self, batches: list[dict[str, Any]]) -> list[int]:
        """[`count_micro_batch_items`] of each micro-batch of a window. The default count reads the device once for
        the whole window (on a GPU, one wait instead of one per micro-batch); an override is called per batch."""
        if self.coupled_mode is not None or (
            type(self).count_micro_batch_items is not GradAccumTrainer.count_micro_batch_items
        ):
            return [self._declared_items(batch) for batch in batches]
        return read_counts([self._items_on_device(batch) for batch in batches])

    def _micro_batch_items(self, batch: dict[str, Any]) -> int:
        """[`count_micro_batch_items`] of `batch`, as counted when its window was prefetched if it is that very
        object (the identity check keeps a batch a parent rebuilt, or a chunk after an OOM, from reusing it)."""
        cached = self._window_counts.get(id(batch))
        if cached is not None and cached[0] is batch:
            return cached[1]
        return self._declared_items(batch)

    def _shifts_labels(self) -> bool:
        """Whether items are counted as a causal LM's loss sees them (`labels[..., 1:]`), decided once per model."""
        return shifts_labels(self)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Prefetch one window as the stock Trainer does; settle the loss rule on the first window, count the window's
        items, and start what its loss needs over the whole window (`trainer/window_start.py`)."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        # Kept so that an out-of-memory error can redo the window from its first micro-batch.
        self._window_batches = batch_samples
        self._micro_index = 0
        # Before any count: the first window settles what the model's loss is normalised by (or stops).
        self._loss_rule.window_prefetched(self, batch_samples)
        counts = count_prefetched_window(self, batch_samples)
        # A user's `compute_loss` gets what the stock Trainer would hand it (as the measurement did).
        self._stock_num_items = stock_num_items(self, batch_samples) if hands_stock_items(self) else None
        start_window(self, batch_samples, counts)
        # `None`: the model computes its own per-micro-batch mean, which the accumulator weights.
        return batch_samples, None

    def verify_accumulation(self, batches: list[dict[str, Any]]):
        """Split-invariance check of accumulation on `batches` (`verify_accumulation` option); see
        [`~hf_gradaccum.verification.verify_split_invariance`] (in the coupled-loss mode, its coupled form). Returns
        its result (`None` if the window is too small)."""
        if self.coupled_mode is not None:
            return self.coupled_mode.verify(self, batches)
        return check_trainer_window(self, batches)

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
        call = None if self._loop_calls is None else self._loop_calls.current
        if call is not None and call.strict:
            call.calls += 1  # under DeepSpeed and the coupled mode, counted only (one per loop call)
        if self._deepspeed_window is not None:
            return self._deepspeed_step(model, inputs)
        if self.coupled_mode is not None:
            return self.coupled_mode.training_step(
                self, model, inputs, functools.partial(self._accumulated_step, model, inputs)
            )
        return self._accumulated_step(model, inputs)

    def _deepspeed_step(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """One micro-batch under DeepSpeed: the parents' own `training_step`, its loss weighted on the way to
        DeepSpeed's engine. Returns the micro-batch's share of the window's mean loss, as `_accumulated_step`."""
        items = self._micro_batch_items(inputs)
        loss = self._deepspeed_window.training_step(items, functools.partial(self._parents_step_as_one, model, inputs))
        return loss * (items / self._window_items_local) if self._window_items_local else loss * 0.0

    def _parents_step_as_one(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The parents' `training_step` with no count handed over, presented as one accumulation step."""
        with presented_as_one_step(self):
            return self._parents_training_step(model, inputs, None)

    def _accumulated_step(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        call = None if self._loop_calls is None else self._loop_calls.current
        if call is not None and not call.strict:
            # A user's override wraps this method: one loop call is one micro-batch, however often it calls this.
            return call.micro_step(model, inputs)
        return self._micro_batch_step(model, self._get_accumulator(model), inputs, None)

    def _micro_batch_step(self, model: nn.Module, accumulator: GradientAccumulator, inputs: dict[str, Any],
                          continues: float | None, last: bool | None = None) -> torch.Tensor:  # fmt: skip
        """One micro-batch (or, with `continues`, one more loss of the micro-batch of that many items) through the
        accumulator; the window ends after it where it is the window's last (`last`, else the loop's sync flag)."""
        # A window left for clipping that the loop neither clipped nor stepped on ends now, before the next one.
        self._window_end.finish(None)
        if continues is None:  # (else the micro-batch the loop handed over is the one running)
            place_in_window(self, accumulator, inputs)
        micro_index = self._micro_index
        self._micro_index += continues is None

        micro_step = functools.partial(self._accumulate, model, accumulator, continues=continues)
        if self.args.auto_find_batch_size and continues is None:
            loss, num_items = self.oom_retry.run(accumulator, self._window_batches, micro_index, micro_step)
        else:
            loss, num_items = micro_step(inputs)
        self._micro_items = num_items

        # Outside `train()` each call is a window of its own: Accelerate's `sync_gradients` is process-wide state that
        # an interrupted `train()` can leave False.
        if last is None:
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

    def _accumulate(self, model: nn.Module, accumulator: GradientAccumulator, inputs: dict[str, Any],
                    continues: float | None = None):  # fmt: skip
        """Forward + weighted backward of one micro-batch (in chunks after an OOM), or one more loss of the micro-batch
        of `continues` items. Returns (mean loss, items)."""
        loss_sum, total_items = None, 0
        for chunk in self.oom_retry.chunks(inputs):
            # The count made at prefetch time where the loss sees that very batch (else it is counted at the loss),
            # and for a loss that divides by what it is handed, the count of the batch handed over.
            counted = self._micro_batch_items(chunk) if self._count_at_prefetch or self._handed_count else None
            share = handed_window_share(self) if counted is not None and self._handed_count else 1
            if share > 1:
                # GOLD and IW-OPD are handed the whole window at every micro-step: each slice takes an equal share.
                counted = counted / share
            loss, num_items = MicroBatchRun(self, model, accumulator, chunk, counted, continues=continues).run()
            weighted = loss.float() * num_items if num_items else torch.zeros((), device=loss.device)
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            total_items += num_items
        return (loss_sum / total_items if total_items else loss_sum), total_items

    def _parents_training_step(self, model: nn.Module, inputs: Any, num_items: torch.Tensor | None) -> torch.Tensor:
        """The parent classes' own `training_step`, unpatched ([`MicroBatchRun`] runs one micro-batch through it)."""
        return super().training_step(model, inputs, num_items)

    def _install_loss_handover(self, accumulator: GradientAccumulator | None = None) -> None:
        """Install the scaler through which Accelerate hands each loss to the accumulator, where one is needed
        ([`install_window_scaler`])."""
        install_window_scaler(self, accumulator)

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
        instead of the micro-batch's own for its length (`integrations/trl/kto.py`).
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
        path, self._resume_state_path = resume_state_path(self, resume_from_checkpoint)
        if self._resume_state_path and self._run_batch is not None:
            saved = torch.load(self._resume_state_path, weights_only=False).get("run_batch")
            self._run_batch.check_resume(saved, path)
        if self._resume_state_path and self.accumulator is not None:
            load_accumulator_state(self, self.accumulator, self._resume_state_path)
        self._training = True
        try:
            with LoopCalls.installed(self):
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
            save_accumulator_state(self, output_dir)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Stock unless `atomic_checkpoints=True` (opt-in; see `trainer/atomic_checkpoints.py` for why it needs this).
        if not gradaccum_option(self.args, "atomic_checkpoints"):
            return super()._save_checkpoint(model, trial)
        save_checkpoint_atomically(self, functools.partial(super()._save_checkpoint, model, trial), trial)

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.accumulator is not None and ("loss" in logs or "train_loss" in logs):
            # In place, as `Trainer.log` adds `epoch` in place: callers (e.g. `train()` building
            # `train_results.json`) see every key the stock Trainer would give them, plus ours.
            logs.update(self.accumulator.metrics())
        super().log(logs, start_time)
