"""`GradientAccumulator`: explicit fp32 accumulation buffers and item weighting, so N micro-batches give exactly the
large-batch update.

How it works, in one paragraph. Every trainable parameter gets a view into one flat buffer per device (fp32 by
default, `buffers.py`). A post-accumulate-grad hook on each parameter folds its gradient into its view as soon as
autograd produces it, weighted by the micro-batch's item count, and frees `.grad`, so the gradients never exist twice.
At the end of a window the buffer holds `sum_k n_k * grad(mean_loss_k)`; dividing by `N = sum_k n_k` gives the
large-batch mean gradient whatever the micro-batch sizes, and it is written back into `.grad` (as a view of the buffer
when the dtypes agree, so no copy) for clipping and `optimizer.step()`. Weighting by `n_k` during the window and
dividing by `N` at its end is the same as weighting each loss by `n_k / N`, but it does not need to know `N` up front,
so windows need not be prefetched (prefetching images holds a whole window in memory). Under `torch.distributed` the
flat buffer is all-reduced once per window, together with one small vector of counts (`reduction.py`), instead of
once per micro-batch. FSDP2 models keep sharded buffers (`sharded/`). fp16 overflows redo one micro-batch (`recompute.py`); the
window's running totals live in `window.py`. Where the parameters are already in the accumulation dtype and nothing
must be checked before a gradient is accumulated (no fp16 loss scaling, replicated, not offloaded), the hooks are
not needed: the in-place path (`in_place.py`) weights each loss by its items and lets autograd accumulate `.grad`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .buffers import resolve_accumulation_dtype
from .in_place import InPlaceGradients, check_accumulation_path, why_not_in_place
from .items import count_items_in_batch
from .loss_normalisation import NAMED_RULES, SUM, NormalisationFinding, batch_count
from .loss_scaling import DynamicLossScaler
from .model_inspection import loss_shifts_labels
from .presented_gradients import PresentedGradients
from .recompute import MicroBatch, back_off_after_overflow, gradients_overflowed
from .reduction import reduce_window, world_size_and_rank
from .run_batch.layout import run_batch_accumulation_steps
from .sharded.buffer_choice import gradient_buffers_for, refuse_sharded_engines
from .sharded.fsdp2_buffers import is_dtensor
from .sharded.fsdp2_schedule import check_fsdp_reduce_schedule, make_fsdp_reduce_schedule
from .sharded.tensor_parallel import data_parallel_reduction
from .validation import check_positive_int
from .window import WindowResult, WindowState

logger = logging.getLogger(__name__)

OVERFLOW_POLICIES = ("recompute", "skip")

__all__ = ["OVERFLOW_POLICIES", "GradientAccumulator", "WindowResult", "resolve_accumulation_dtype"]


def validate_accumulation_steps(steps: Any, name: str = "gradient_accumulation_steps") -> int:
    """Return `steps` if it is an `int >= 1`; otherwise raise a `ValueError` naming `name`."""
    return check_positive_int(steps, name)


class GradientAccumulator:
    """
    Accumulates gradients over `gradient_accumulation_steps` micro-batches in explicit buffers, so that one optimizer
    step equals the large-batch step on the same samples.

    Args:
        model (`nn.Module` or iterable of `nn.Parameter`):
            The model (or its parameters). A DDP-wrapped model is fine: the hooks sit on the shared parameters.
        gradient_accumulation_steps (`int`, *optional*, defaults to 1):
            Micro-batches per optimizer step.
        accumulation_dtype (`str` or `torch.dtype`, *optional*, defaults to `torch.float32`):
            dtype of the accumulation buffers. fp32 keeps bf16/fp16 gradients from rounding at every micro-batch.
        loss_scaler ([`DynamicLossScaler`], *optional*):
            fp16 dynamic loss scaling. The scale is the same for every micro-batch of a window and gradients are
            unscaled as they are folded into the buffers.
        overflow_policy (`str`, *optional*, defaults to `"recompute"`):
            With a `loss_scaler`, what an overflowing micro-batch costs: `"recompute"` discards only that micro-batch
            and redoes it at the backed-off scale (needs [`~GradientAccumulator.accumulate_micro_batch`]),
            `"skip"` drops the whole window.
        max_recompute_attempts (`int`, *optional*, defaults to 8):
            Backoffs tried for one micro-batch before it is treated as a real inf/NaN and the window is skipped.
        reduce_gradients (`bool`, *optional*):
            All-reduce buffers and counts across `torch.distributed` ranks at the end of each window. Defaults to
            `True` when a process group with more than one rank is initialised.
        fsdp_reduce_schedule (`str`, *optional*, defaults to `"every_micro_batch"`):
            FSDP2 models only: `"every_micro_batch"` reduce-scatters each micro-batch into the sharded fp32 buffer
            (gradient memory 1/world_size); `"once_per_window"` turns FSDP2's gradient sync off for all but the
            window's last micro-batch (one reduce-scatter per window, one unsharded gradient per rank in between).
            See `engine/sharded/fsdp2_schedule.py` for what it refuses and why.
        data_parallel_group (`torch.distributed.ProcessGroup`, *optional*):
            Under tensor parallelism, the process group of the ranks that see different batches (e.g.
            `device_mesh["dp"].get_group()`): the window's items and replicated gradients are summed over it alone.
            Not needed when the tensor-parallel dimension spans every rank. `None` (the default): every rank.
        offload_accumulation_buffer (`bool`, *optional*, defaults to `False`):
            Keep the accumulation buffer in pinned host memory instead of on the GPU: each gradient is copied out as
            autograd produces it (on a side stream) and folded on the host, so the GPU holds about one parameter's
            gradient at a time; the mean gradient returns to the GPU, in the parameters' dtype, at the window's end.
            Same update as the GPU buffer. Replicated (single-device, DDP) parameters only; see `engine/offload.py`.
        accumulation_path (`str`, *optional*, defaults to `"auto"`):
            How gradients reach the accumulation: `"hooks"` folds each parameter's gradient into a flat buffer as
            autograd produces it (needed for bf16/fp16 parameters with fp32 buffers, fp16 loss scaling, FSDP2,
            tensor parallelism and the offloaded buffer); `"in_place"` weights each micro-batch's loss by its items
            and lets autograd accumulate `.grad` itself, with no hook (parameters already in `accumulation_dtype`,
            none of the above; a `ValueError` says why otherwise); `"auto"` takes `"in_place"` where it applies.
            Both give the same update. On the in-place path every loss must pass through the accumulator
            ([`backward`], [`accumulate_micro_batch`] or [`loss_to_backward`]); see `engine/in_place.py`.
        effective_batch_size (`int`, *optional*):
            The run's batch, rows per window over all ranks: `gradient_accumulation_steps` is derived from it,
            `micro_batch_size` and the number of ranks, for a loader built on a [`RunBatchSampler`] with the same
            values (any batch on any number of processes; docs/run_batch.md).
        micro_batch_size (`int`, *optional*):
            With `effective_batch_size`: the largest micro-batch a rank runs.

        loss_normalisation (`str`, *optional*, defaults to `"auto"`):
            What [`backward`]`(loss, batch=...)` weights a transformers model's micro-batch by. `"auto"`: measured on
            the first batch given, before anything is folded (a mean over label tokens, shifted label tokens, rows,
            boxes or another count the batch carries, or a sum; `losses/plain_loop.py`), and a loss no
            weighting makes exact (BatchNorm, an in-batch or router loss, terms with their own counts) raises a
            `ModelLossError`. Or name it: `"label_tokens"`, `"shifted_label_tokens"`, `"rows"`, `"sum"`, `"boxes"`.
        batchnorm_statistics (`str`, *optional*, defaults to `"stop"`):
            `"micro_batch"` accepts BatchNorm layers in training mode (per-micro-batch statistics, knowingly);
            `"stop"` refuses them at the first `batch=`.

    Example (a plain PyTorch loop; see `recipes/plain_accelerate_loop.py` for the Accelerate version):

    ```python
    >>> import torch
    >>> from hf_gradaccum import GradientAccumulator
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> accumulator = GradientAccumulator(model, gradient_accumulation_steps=2)
    >>> loader = ((torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(5))  # a generator: no len()
    >>> for x, y in loader:
    ...     loss = torch.nn.functional.cross_entropy(model(x), y)
    ...     accumulator.backward(loss, num_items=len(y))
    ...     if accumulator.sync_gradients:
    ...         result = accumulator.step(optimizer, max_grad_norm=1.0)
    >>> result = accumulator.flush(optimizer, max_grad_norm=1.0)  # the partial last window (1 of 2 micro-batches)
    >>> accumulator.applied_steps
    3
    ```

    The loop steps at each full window (`sync_gradients`); after it, [`flush`] steps on what is left, a partial
    window of fewer micro-batches, with the same exactness (its mean divides by its own items), and does nothing when
    the loader's length was a multiple of `gradient_accumulation_steps`. So the loader needs no `len()`. For a
    transformers model, `accumulator.backward(loss, batch=batch)` counts the items as the model's loss does.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[nn.Parameter],
        gradient_accumulation_steps: int = 1,
        *,
        accumulation_dtype: str | torch.dtype = torch.float32,
        loss_scaler: DynamicLossScaler | None = None,
        overflow_policy: str = "recompute",
        max_recompute_attempts: int = 8,
        reduce_gradients: bool | None = None,
        fsdp_reduce_schedule: str = "every_micro_batch",
        offload_accumulation_buffer: bool = False,
        data_parallel_group: torch.distributed.ProcessGroup | None = None,
        accumulation_path: str = "auto",
        effective_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        loss_normalisation: str = "auto",
        batchnorm_statistics: str = "stop",
    ) -> None:
        if effective_batch_size is not None:
            world_size = world_size_and_rank(reduce_gradients, data_parallel_group)[0]
            gradient_accumulation_steps = run_batch_accumulation_steps(
                effective_batch_size, micro_batch_size, world_size, gradient_accumulation_steps
            )
        self.gradient_accumulation_steps = validate_accumulation_steps(gradient_accumulation_steps)
        self.accumulation_dtype = resolve_accumulation_dtype(accumulation_dtype)
        if overflow_policy not in OVERFLOW_POLICIES:
            raise ValueError(f"`overflow_policy` must be one of {OVERFLOW_POLICIES}, got {overflow_policy!r}.")
        self.overflow_policy = overflow_policy
        check_fsdp_reduce_schedule(fsdp_reduce_schedule)
        check_accumulation_path(accumulation_path)
        if loss_normalisation not in ("auto", *NAMED_RULES):
            raise ValueError(
                f"`loss_normalisation` must be one of {['auto', *NAMED_RULES]}, got {loss_normalisation!r}."
            )
        if batchnorm_statistics not in ("stop", "micro_batch"):
            raise ValueError(f"`batchnorm_statistics` must be 'stop' or 'micro_batch', got {batchnorm_statistics!r}.")
        self.loss_normalisation = loss_normalisation
        self.batchnorm_statistics = batchnorm_statistics
        # What `backward(loss, batch=...)` weights by, settled on the first batch given (`losses/plain_loop.py`).
        self.normalisation: NormalisationFinding | None = None
        if not isinstance(offload_accumulation_buffer, bool):
            raise ValueError(
                f"`offload_accumulation_buffer` must be True or False, got {offload_accumulation_buffer!r}."
            )
        self.max_recompute_attempts = validate_accumulation_steps(max_recompute_attempts, "max_recompute_attempts")
        self.loss_scaler = loss_scaler
        self._reduce_gradients = reduce_gradients

        refuse_sharded_engines(model)
        # What `backward(loss, batch=...)` counts: learned once from the model itself, by duck typing (the engine does
        # not import transformers), at the first `batch=`; parameters carry no such knowledge.
        self._model = model if isinstance(model, nn.Module) else None
        self._shift: tuple[bool | None] | None = None  # the cached answer, once asked
        params = model.parameters() if isinstance(model, nn.Module) else model
        seen: set[int] = set()
        self.parameters: list[nn.Parameter] = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.parameters.append(p)
        if not self.parameters:
            raise ValueError("`model` has no trainable parameters (none with `requires_grad=True`).")

        # FSDP2 models get sharded buffers (`sharded/fsdp2_buffers.py`), others replicated ones (`buffers.py`). What differs between
        # the two (where the item weight is applied, how a micro-batch's flags are agreed, who reduces) is asked of
        # `self.buffers`, so the loop below has one code path for both.
        not_in_place = why_not_in_place(
            self.parameters,
            self.accumulation_dtype,
            loss_scaled=loss_scaler is not None,
            offload=offload_accumulation_buffer,
            distributed_tensors=any(is_dtensor(p) for p in self.parameters),
        )
        if accumulation_path == "in_place" and not_in_place:
            raise ValueError(
                f"`accumulation_path='in_place'` cannot be exact here: {not_in_place}. Use `accumulation_path='auto'` "
                "(which takes the hook path then) or `'hooks'`."
            )
        self.in_place = accumulation_path != "hooks" and not_in_place is None
        """Whether autograd accumulates `.grad` itself, each loss weighted by its items (`in_place.py`)."""
        if self.in_place:
            self.buffers = InPlaceGradients(self.parameters, self.accumulation_dtype)
        else:
            self.buffers = gradient_buffers_for(
                model, self.parameters, self.accumulation_dtype, reduce_gradients, offload=offload_accumulation_buffer
            )
        self.sharded = self.buffers.sharded
        self.sums_losses = False
        """Whether each micro-batch's loss is already its share of the window's loss (a loss that is a sum over its
        rows, or one weighted per term by the window's counts): the window is then not divided by its items."""
        # Tensor parallelism: a tensor-parallel group shares its batch, so the window is summed over the ranks that
        # see different batches only (`tensor_parallel.py`).
        self._data_parallel_group = data_parallel_group
        self._reduce_gradients = data_parallel_reduction(self.parameters, reduce_gradients, data_parallel_group)
        # `None` unless FSDP2's gradient sync is scheduled (`fsdp_reduce_schedule="once_per_window"`).
        self.fsdp_schedule = make_fsdp_reduce_schedule(
            fsdp_reduce_schedule,
            model,
            sharded=self.sharded,
            loss_scaled=loss_scaler is not None,
            overflow_policy=overflow_policy,
        )

        # `_fold_alpha` is set only from `begin_micro_batch` to `end_micro_batch`, so a backward the accumulator did
        # not ask for (an eval pass, a user's auxiliary loss) leaves `.grad` as plain PyTorch would.
        self._fold_alpha: float | None = None
        self._defer_fold = False
        self._micro: MicroBatch | None = None
        self._hooks = (
            []
            if self.in_place
            else [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.parameters)]
        )

        self._window: WindowState | None = None
        # In-place path: the gradients' identities and version counters after the latest micro-batch, compared at
        # the next one and at the window's end (`_check_in_place_unchanged`).
        self._in_place_state: list | None = None
        self._finished: tuple[WindowState, float] | None = None  # the last window's end, for `reopen_window`
        self._zero_item_backwards = 0  # FSDP2: weight-0 backwards of item-less micro-batches in this window
        self.micro_step = 0
        self.applied_steps = 0
        self.skipped_steps: Counter[str] = Counter()
        self.recomputed_micro_batches = 0
        self.num_gradient_reductions = 0
        self.num_collectives = 0
        self.last_result: WindowResult | None = None

    # ------------------------------------------------------------------ hooks and folding
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def fold(param: torch.Tensor) -> None:
            if self._micro is not None:
                self._micro.gradients_arrived = True
            if self._fold_alpha is None or self._defer_fold or param.grad is None:
                return
            self._fold(index, param)

        return fold

    def _fold(self, index: int, param: torch.Tensor) -> None:
        self.buffers.fold(index, param.grad, self._fold_alpha)
        self._window.touched[index] = True
        param.grad = None

    def _start_window(self) -> None:
        self._finished = None
        self.buffers.zero_()
        # Gradients left from the previous step (possibly views of the buffer) must not be accumulated into.
        for p in self.parameters:
            p.grad = None
        self._window = WindowState(len(self.parameters), self.buffers.first_device)
        self._in_place_state = self.buffers.fingerprint() if self.in_place else None

    # ------------------------------------------------------------------ micro-batches
    @property
    def sync_gradients(self) -> bool:
        """Whether the current window is full, i.e. the next call should be [`step`] or [`finish_window`]."""
        return self._window is not None and self._window.micro_steps >= self.gradient_accumulation_steps

    @property
    def micro_steps_in_window(self) -> int:
        """Micro-batches accumulated in the current window so far."""
        return 0 if self._window is None else self._window.micro_steps

    @property
    def current_scale(self) -> float:
        """The loss scale used for the current window (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module | None = None) -> Iterator[None]:
        """
        Context for one micro-batch's forward and backward: under DDP it disables DDP's per-backward all-reduce
        (the accumulator reduces the buffers once per window instead). A no-op for unwrapped models.
        """
        no_sync = getattr(model, "no_sync", None)
        with no_sync() if callable(no_sync) else contextlib.nullcontext():
            yield

    def backward(
        self,
        loss: torch.Tensor,
        num_items: int | float | torch.Tensor | None = None,
        *,
        batch: Mapping[str, Any] | None = None,
    ) -> None:
        """
        Backward one micro-batch's mean loss, weighted by its item count.

        Args:
            loss (`torch.Tensor`): the micro-batch's loss, a mean over its `num_items` items.
            num_items (`int`, *optional*): items the mean divides by (see [`count_items`]). `None` (and no `batch`)
                weights every micro-batch equally, which is only exact when they all hold the same number of items.
            batch (`Mapping`, *optional*): the micro-batch the loss was computed on, instead of `num_items`: the
                accumulator counts its items itself, as the model's own loss does ([`count_items_in_batch`] with the
                label shift of a causal LM, learned from the `model` given to the constructor: see
                [`loss_shifts_labels`]). Raises a `ValueError` when the model was given as parameters or is not a
                transformers model whose loss it can recognise; pass `num_items` then.

        A micro-batch with zero items contributes nothing (its mean is 0/0). Under FSDP2 it still runs a backward
        with weight 0, because every rank must join each micro-batch's reduce-scatter. The window a non-finite loss
        belongs to is skipped at [`finish_window`] (weights and optimizer state untouched); under FSDP2 and fp16
        `"recompute"` that loss is not back-propagated at all, elsewhere it is (its gradients are discarded with
        the window) so that the host never waits for the device to read the loss. Under fp16 loss scaling
        this method cannot re-run the forward pass, so an overflow skips the window: use [`accumulate_micro_batch`]
        for `"recompute"`.
        """
        self.begin_micro_batch(num_items, batch=batch)
        self._backward_attempt(loss)
        self.end_micro_batch(loss.detach())

    def accumulate_micro_batch(
        self,
        compute_loss: Callable[[], torch.Tensor],
        num_items: int | float | torch.Tensor | None = None,
        *,
        batch: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """
        Run `compute_loss()` (the forward pass) and [`backward`] on its result. With an fp16 loss scaler and
        `overflow_policy="recompute"`, an overflowing micro-batch is discarded, the scale backs off, and
        `compute_loss()` runs again at the new scale; no other micro-batch of the window is redone. `num_items` and
        `batch` are as in [`backward`].

        Returns:
            `torch.Tensor`: the detached loss of the (last) attempt.
        """
        self.begin_micro_batch(num_items, batch=batch, can_recompute=True)
        while True:
            loss = compute_loss()
            self._backward_attempt(loss)
            if not self.end_micro_batch(loss.detach()):
                return loss.detach()

    # ------------------------------------------------------------------ one micro-batch, in three calls
    def begin_micro_batch(
        self,
        num_items: int | float | torch.Tensor | None = None,
        *,
        batch: Mapping[str, Any] | None = None,
        can_recompute: bool = False,
        continues: bool = False,
    ) -> None:
        """
        Start one micro-batch of `num_items` items (or the items of `batch`, as in [`backward`]): from here to
        [`end_micro_batch`], the gradients of a backward are this micro-batch's. Back-propagate
        `loss_to_backward(loss)`, then call `end_micro_batch(loss)`; when that returns `True` (an fp16 overflow under
        `overflow_policy="recompute"`, only with `can_recompute=True`), compute the loss again and repeat those two
        steps. Where [`loss_factor_is_one`] is `True` (no loss scaling, replicated buffers), `loss.backward()` itself
        may be used: the item weight is applied as the gradients are folded. [`backward`] and
        [`accumulate_micro_batch`] are these calls for a plain loop; the Trainer adapter makes them around its
        parent's own `training_step`. With `continues=True` the backward is one more loss of the micro-batch just
        ended (a second loss over the same `num_items`, such as a `training_step` that back-propagates the batch and
        an augmented copy): weighted alike, it adds neither a micro-step nor items to the window.

        Example:

        ```python
        >>> import torch
        >>> from hf_gradaccum import GradientAccumulator
        >>> model = torch.nn.Linear(2, 1)
        >>> acc = GradientAccumulator(model, gradient_accumulation_steps=1)
        >>> acc.begin_micro_batch(num_items=3)
        >>> loss = model(torch.ones(3, 2)).pow(2).mean()
        >>> acc.loss_to_backward(loss).backward()
        >>> acc.end_micro_batch(loss)
        False
        ```
        """
        n = self._begin_micro_batch(self._resolve_num_items(num_items, batch), continues=continues)
        needed = n > 0 or self.buffers.backward_without_items
        self._zero_item_backwards += needed and n == 0
        recompute = can_recompute and self.loss_scaler is not None and self.overflow_policy == "recompute"
        self._micro = MicroBatch(n, backward_needed=needed, recompute=recompute)
        self._arm(self._micro)

    @property
    def loss_factor_is_one(self) -> bool:
        """Whether [`loss_to_backward`] leaves a finite loss as it is: no loss scaling and replicated buffers on the
        hook path (which apply the item weight as they fold). Then a micro-batch's own `loss.backward()` accumulates
        it exactly."""
        return self.loss_scaler is None and not self.sharded and not self.in_place

    @property
    def current_micro_batch(self) -> MicroBatch | None:
        """The micro-batch between [`begin_micro_batch`] and [`end_micro_batch`] (`None` outside one)."""
        return self._micro

    def loss_to_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """
        The tensor to back-propagate for this micro-batch's mean `loss`: the loss at the window's fp16 scale, under
        FSDP2 also times its items (there the ranks' gradients are summed before the fold). A non-finite loss, and
        a micro-batch without items that needs no backward, get a tensor that back-propagates nothing.
        """
        micro = self._micro
        if micro is None:
            raise RuntimeError("`loss_to_backward` called outside a micro-batch: call `begin_micro_batch` first.")
        if self._loss_check_deferred(micro):
            micro.loss_non_finite = None  # decided in `end_micro_batch`, without waiting for the forward here
        else:
            micro.loss_non_finite = micro.backward_needed and self._loss_non_finite(loss, micro.num_items)
        micro.loss_weighted = True
        if not micro.backward_needed or micro.loss_non_finite:
            # Back-propagating a NaN would only fill the buffer with NaNs; the window is skipped either way.
            return torch.zeros((), device=loss.device, requires_grad=True)
        # FSDP2 (whose buffers need this call, `loss_factor_is_one` is False there): set just before a backward that
        # will run, so that a skipped one leaves FSDP2's unsynced gradients to the window's end.
        for module in self.buffers.fsdp_modules:
            # Reduce-scatter this micro-batch whatever an enclosing context asked for: Accelerate's `no_sync` (the
            # Trainer's non-last micro-batches) would make FSDP2 accumulate unsharded gradients in its own reduce
            # dtype (bf16 under Accelerate's bf16 policy), past the fp32 buffer and the per-micro-batch fp16 check.
            module.set_requires_gradient_sync(True, recurse=False)
        # ... unless the user chose `fsdp_reduce_schedule="once_per_window"`, which turns it off again here for every
        # micro-batch but the window's last.
        if self.fsdp_schedule is not None:
            self.fsdp_schedule.before_backward(last_in_window=self.sync_gradients)
        loss_factor = self.buffers.weighting(micro.num_items, self.current_scale)[0]
        return loss * loss_factor if loss_factor != 1.0 else loss

    def end_micro_batch(self, loss: torch.Tensor) -> bool:
        """
        After the backward: record the micro-batch's (unscaled, detached) `loss` and, under `"recompute"`, check its
        gradients before folding them. Returns `True` when they overflowed and the micro-batch must be computed
        again at the backed-off scale (its gradients are dropped); `False` when it is done.
        """
        micro = self._micro
        if micro is None:
            raise RuntimeError("`end_micro_batch` called outside a micro-batch: call `begin_micro_batch` first.")
        self._fold_alpha, self._defer_fold = None, False
        window, n = self._window, micro.num_items
        if self.in_place and micro.backward_needed:
            self._check_in_place_micro_batch(micro)
        if not micro.backward_needed:
            self._drop_pending()  # a mean over no items is 0/0 and weighs nothing
            self._micro = None
            return False
        if micro.loss_non_finite is None:  # not checked before the backward
            # Replicated buffers without a recompute: the loss enters the window's loss sum on the device, where a
            # non-finite one skips the window at its end (whatever its gradients folded). Reading it here would
            # stall the host on the device once per micro-batch.
            micro.loss_non_finite = False if self._loss_check_deferred(micro) else self._loss_non_finite(loss, n)
        if micro.loss_non_finite:
            self._drop_pending()
            window.record_loss(loss, n)
            window.overflowed = True
            if micro.recompute:
                logger.warning("Non-finite loss in micro-batch %d; the window will be skipped.", self.micro_step)
        elif not micro.recompute:
            window.record_loss(loss, n)
        elif not self.buffers.agree(gradients_overflowed(self.parameters)):
            # Folded only after checking: a folded inf could not be taken out of the buffer again.
            self._fold_pending(n)
            window.record_loss(loss, n)
        else:
            self._drop_pending()
            first = micro.attempt == 0
            if back_off_after_overflow(micro, window, self.loss_scaler, self.max_recompute_attempts, self.micro_step):
                self.recomputed_micro_batches += first
                self._arm(micro)
                return True
        self._micro = None
        return False

    def _arm(self, micro: MicroBatch) -> None:
        """Get ready for `micro`'s backward: how the hooks fold what arrives."""
        micro.loss_non_finite = None
        # Replicated: the item weight is applied at the fold; sharded: in the loss, before the reduce-scatter sums
        # the ranks' gradients (`weighting`).
        self._fold_alpha = self.buffers.weighting(micro.num_items, self.current_scale)[1]
        # Held in `.grad` until `end_micro_batch`: gradients it checks before folding (fp16 recompute), and those of
        # a micro-batch without items (dropped there).
        self._defer_fold = micro.recompute or not micro.backward_needed

    @property
    def loss_shifts_labels(self) -> bool | None:
        """Whether the model's own loss shifts its labels (causal LM), as learned from the `model` given to the
        constructor; `None` when it cannot be told (parameters given, or not a transformers model)."""
        if self._shift is None:
            self._shift = (None if self._model is None else loss_shifts_labels(self._model),)
        return self._shift[0]

    def _resolve_num_items(
        self, num_items: int | float | torch.Tensor | None, batch: Mapping[str, Any] | None
    ) -> int | float | torch.Tensor | None:
        """`num_items`, or the items of `batch` counted as the model's loss counts them; checked before any work."""
        if batch is None:
            return num_items
        if num_items is not None:
            raise ValueError("Pass either `num_items` or `batch` to the accumulator, not both.")
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"`batch` must be a mapping of the model's inputs (e.g. a dict with `labels`), got {type(batch).__name__}."
            )
        shift = self.loss_shifts_labels
        if self._model is None or (shift is None and self.loss_normalisation == "auto"):
            given = (
                "parameters, not the model"
                if self._model is None
                else f"a `{type(self._model).__name__}` that is not a transformers model with a recognisable loss"
            )
            raise ValueError(
                "`batch=` needs to know what the model's loss divides by (a causal LM divides by one token fewer per "
                f"row), and this accumulator cannot tell: it was given {given}. Pass "
                "`num_items=count_items_in_batch(batch, shift_labels=...)` (or `count_items(...)`) instead, or "
                "`loss_normalisation=` to the accumulator."
            )
        if self.normalisation is None:
            self.normalisation = self._settle_normalisation(batch, shift)
        rule = self.normalisation.rule
        if rule == SUM:
            self.sums_losses = True
            return 1
        count = batch_count(rule, batch)
        return count_items_in_batch(batch, shift_labels=bool(shift)) if count is None else count

    def _settle_normalisation(self, batch: Mapping[str, Any], shift: bool | None) -> NormalisationFinding:
        """What `backward(loss, batch=...)` weights by, from the first batch given. The engine alone counts as the
        model's loss is recognised to (label tokens, shifted for a causal LM; rows without labels); the package's
        `hf_gradaccum.GradientAccumulator` measures it instead (`losses/plain_loop.py`)."""
        if self.loss_normalisation != "auto":
            return NormalisationFinding(rule=self.loss_normalisation, decided_by="declared", note="named")
        return NormalisationFinding(rule=self.prior_rule(batch, shift), decided_by="prior", note="not measured")

    @staticmethod
    def prior_rule(batch: Mapping[str, Any], shift: bool | None) -> str:
        """The rule the label count follows on `batch` (see [`count_items_in_batch`])."""
        labels = batch.get("labels")
        if batch.get("shift_labels") is not None:
            return "label_tokens"
        if labels is None or (torch.is_tensor(labels) and labels.is_floating_point()):
            return "rows"
        if isinstance(labels, (list, tuple)):
            return "boxes"
        token_level = torch.is_tensor(labels) and labels.dim() > 1
        return "shifted_label_tokens" if token_level and shift else "label_tokens"

    def _begin_micro_batch(self, num_items: int | float | torch.Tensor | None, continues: bool = False) -> float:
        if continues and (self._window is None or not self._window.micro_steps):
            raise RuntimeError("`continues=True` needs a micro-batch of this window to continue.")
        if self._window is None:
            self._start_window()
        elif self.in_place:
            self._check_in_place_unchanged()
        if not continues:
            self.micro_step += 1
            self._window.micro_steps += 1
        if num_items is None:
            n = 1.0
        else:
            n = float(num_items.item() if torch.is_tensor(num_items) else num_items)
            if n < 0 or not math.isfinite(n):
                raise ValueError(f"`num_items` must be a finite number >= 0, got {num_items!r}.")
        if not continues:
            self._window.items += n
        return n

    def _backward_attempt(self, loss: torch.Tensor) -> None:
        try:
            self.loss_to_backward(loss).backward()
        except BaseException:
            # A backward the accumulator did not ask for (an eval pass, a user's auxiliary loss) after this one must
            # leave `.grad` as plain PyTorch would.
            self._fold_alpha, self._defer_fold = None, False
            raise

    def _loss_check_deferred(self, micro: MicroBatch) -> bool:
        """Whether a non-finite loss may be left to the window's end: replicated buffers (no rank must agree on it
        before the backward) and no fp16 recompute (which checks each micro-batch before folding it)."""
        return micro.backward_needed and not micro.recompute and not self.sharded

    def _loss_non_finite(self, loss: torch.Tensor, n: float) -> bool:
        """Whether the micro-batch's loss is inf/NaN (on any rank, when sharded). A zero-item micro-batch's loss is
        0/0 by construction and weighs nothing, so it never counts as non-finite."""
        return self.buffers.agree(n > 0 and not bool(torch.isfinite(loss.detach()).all()))

    def _drop_pending(self) -> None:
        if self.in_place:
            return  # `.grad` holds the window's sum, and a dropped micro-batch back-propagated nothing into it
        for p in self.parameters:
            p.grad = None

    def _fold_pending(self, n: float) -> None:
        self._fold_alpha = self.buffers.weighting(n, self.current_scale)[1]
        try:
            for i, p in enumerate(self.parameters):
                if p.grad is not None:
                    self._fold(i, p)
        finally:
            self._fold_alpha = None

    def discard_window(self) -> None:
        """
        Throw away everything accumulated in the current window (e.g. after an out-of-memory error in the middle of
        a backward pass, when part of a micro-batch may already be folded), so it can be recomputed from its start.
        """
        if self._window is not None:
            self.micro_step -= self._window.micro_steps
        self._window = None
        self._in_place_state = None
        self._finished = None
        self._micro, self._fold_alpha, self._defer_fold = None, None, False
        self._zero_item_backwards = 0
        if self.fsdp_schedule is not None:
            self.fsdp_schedule.discard()
        for p in self.parameters:
            p.grad = None

    # ------------------------------------------------------------------ window end
    def finish_window(self, *, max_grad_norm: float | None = None) -> WindowResult:
        """
        End the current window: reduce across ranks (if distributed), check it, and write the large-batch mean
        gradient into each parameter's `.grad` (`None` for parameters that got no gradient), ready for clipping and
        `optimizer.step()`. A window with no items or with a non-finite loss or gradient is skipped: every `.grad` is
        set to `None`, so optimizers leave weights and state untouched. Works for partial windows (end of epoch).

        Args:
            max_grad_norm (`float`, *optional*):
                Also clip the applied mean gradient to this total L2 norm, as `torch.nn.utils.clip_grad_norm_` does
                (`float("inf")`: measure it only), and put its norm before clipping in `result.grad_norm`. On the
                in-place path the division by the window's items, the check and the clipping then share clipping's
                own two passes over the gradients, instead of a pass of their own before it.

        Example:

        ```python
        >>> import torch
        >>> from hf_gradaccum import GradientAccumulator
        >>> model = torch.nn.Linear(2, 1)
        >>> acc = GradientAccumulator(model, 2)
        >>> for x in (torch.ones(3, 2), torch.ones(1, 2)):
        ...     acc.backward(model(x).sum() / len(x), num_items=len(x))
        >>> result = acc.finish_window(max_grad_norm=1.0)  # the mean gradient (1, 1, 1), clipped to norm 1
        >>> round(result.grad_norm, 4), round(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()), 4)
        (1.7321, 1.0)
        ```
        """
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool) and max_grad_norm > 0
        ):
            raise ValueError(
                f"`max_grad_norm` must be a positive number (`float('inf')` to measure the norm without clipping) or "
                f"None, got {max_grad_norm!r}."
            )
        window = self._window
        if window is None or window.micro_steps == 0:
            raise RuntimeError("`finish_window()` called before any micro-batch of the window was accumulated.")
        self._flush_fsdp_schedule()
        if self.in_place:
            self._check_in_place_unchanged()
            window.touched = self.buffers.local_touched()
        else:
            for p in self.parameters:
                if p.grad is not None:
                    raise RuntimeError(
                        "A parameter has a `.grad` that the accumulator did not fold: call `accumulator.backward(loss)` "
                        "(or `accumulate_micro_batch`) instead of `loss.backward()`."
                    )

        world, rank = world_size_and_rank(self._reduce_gradients, self._data_parallel_group)
        reduced, collectives = reduce_window(
            window,
            self.buffers,
            self.current_scale,
            world,
            rank,
            reduce_buffers=self.buffers.reduced_at_window_end,
            group=self._data_parallel_group,
        )
        if world > 1:
            self.num_gradient_reductions += 1
            self.num_collectives += collectives
        items, loss_sum = reduced.items, reduced.loss_sum
        # A loss that is a sum over its rows (each micro-batch's loss already its share of the window's) is not divided.
        divisor = 1.0 if self.sums_losses else items
        # The in-place path divides by the window's items in the same pass that checks the gradients (and clips them,
        # when asked to).
        prescaled = self.in_place and items > 0
        grad_norm = None
        if prescaled and max_grad_norm is not None:
            finite_grads, grad_norm = self.buffers.mean_clip_and_check_(divisor, float(max_grad_norm))
        elif prescaled:
            finite_grads = self.buffers.scale_and_check_(1.0 / divisor)
        else:
            finite_grads = self.buffers.all_finite_on_every_rank()
        skip_reason = None
        if items == 0:
            skip_reason = "no_items"
        elif not math.isfinite(loss_sum):
            skip_reason = "non_finite_loss"
        elif reduced.overflowed:
            skip_reason = "overflow"
        elif not finite_grads:
            skip_reason = "non_finite_grad" if self.loss_scaler is None else "overflow"

        if skip_reason is None:
            if not prescaled:
                self.buffers.scale_(1.0 / divisor)
            for i, (p, got_grad) in enumerate(zip(self.parameters, reduced.touched, strict=True)):
                # Same dtype: the buffer view *is* the gradient, so no second copy of the gradients exists.
                p.grad = self.buffers.gradient_for(i, p.dtype) if got_grad else None
            if max_grad_norm is not None and not prescaled:
                norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_grad_norm)
                # FSDP2: the norm is a DTensor over the shards; `full_tensor()` is the global norm.
                grad_norm = float(norm.full_tensor() if is_dtensor(norm) else norm)
            self.applied_steps += 1
        else:
            for p in self.parameters:
                p.grad = None
            self.skipped_steps[skip_reason] += 1
            logger.warning(
                "Skipping optimizer step %d: %s.", self.applied_steps + sum(self.skipped_steps.values()), skip_reason
            )
            if skip_reason in ("non_finite_grad", "overflow") and self._zero_item_backwards:
                logger.warning(
                    "This rank ran %d weight-0 backward(s) for micro-batches without items in this window (FSDP2 needs "
                    "every rank in every reduce-scatter). If your loss is a hand-written masked mean such as "
                    "`(loss * mask).sum() / mask.sum()`, its gradient at zero items is NaN even at weight 0, and "
                    "every such window is skipped: divide by `mask.sum().clamp(min=1)` (F.cross_entropy with "
                    "`ignore_index`, as transformers' models use, is fine).",
                    self._zero_item_backwards,
                )
        self._zero_item_backwards = 0

        if self.loss_scaler is not None:
            self._update_loss_scale(skip_reason, reduced.backoffs > 0, reduced.min_scale)

        result = WindowResult(
            applied=skip_reason is None,
            num_items=items,
            loss=loss_sum / divisor if items > 0 else None,
            micro_steps=window.micro_steps,
            skip_reason=skip_reason,
            recomputed_micro_batches=window.recomputed,
            grad_norm=grad_norm if skip_reason is None else None,
        )
        # What `reopen_window` needs to take this end back: replicated gradients on one process, unscaled, unclipped.
        reopenable = skip_reason is None and world == 1 and self.loss_scaler is None and not self.sharded
        self._finished = (window, divisor) if reopenable and max_grad_norm is None else None
        self._window = None
        self._in_place_state = None
        self.last_result = result
        return result

    def reopen_window(self) -> None:
        """
        Take back the last [`finish_window`], so that more backwards of the window's last micro-batch can join it
        (a Trainer's `training_step` that calls its parent's twice: the window ended in the first call). The mean
        gradient in `.grad` becomes the window's sum again. Only for a window that was applied, on one process,
        without loss scaling or clipping (else a `RuntimeError`: what was reduced, unscaled or clipped cannot be
        taken back exactly).

        Example:

        ```python
        >>> import torch
        >>> from hf_gradaccum import GradientAccumulator
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> acc = GradientAccumulator(model, 1)
        >>> acc.backward(model(torch.ones(2, 2)).sum() / 2, num_items=2)
        >>> _ = acc.finish_window()
        >>> acc.reopen_window()
        >>> acc.begin_micro_batch(2, continues=True)
        >>> acc.loss_to_backward(model(torch.ones(2, 2)).sum() / 2).backward()
        >>> acc.end_micro_batch(torch.zeros(()))
        False
        >>> acc.finish_window().micro_steps, model.weight.grad.tolist()
        (1, [[2.0, 2.0]])
        ```
        """
        finished, self._finished = self._finished, None
        if finished is None or self._window is not None:
            raise RuntimeError(
                "The last window cannot be reopened: it was skipped, reduced across processes, loss-scaled or "
                "clipped when it ended, or another window has started since."
            )
        window, divisor = finished
        if self.in_place:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.mul_(divisor)
        else:
            self.buffers.scale_(divisor)
            for p in self.parameters:
                p.grad = None
        self._window = window
        self._in_place_state = self.buffers.fingerprint() if self.in_place else None
        self.applied_steps -= 1
        self.last_result = None

    def present_window_so_far(self, num_items: float) -> PresentedGradients | None:
        """Show the window's gradient so far as a mean over `num_items` in `.grad`, as copies that code between
        micro-batches may read or change without reaching the window ([`PresentedGradients`]); `None` where the
        buffers cannot be shown so (sharded, offloaded) or no window is open."""
        if self._window is None or self._micro is not None or not num_items:
            return None
        return PresentedGradients.of(self, num_items)

    def _check_in_place_micro_batch(self, micro: MicroBatch) -> None:
        """After an in-place micro-batch's backward: its loss must have been weighted (`loss_to_backward`), else the
        window is discarded and refused. Then the gradients' state is recorded for the next check."""
        if not micro.loss_weighted:
            self.discard_window()
            raise RuntimeError(
                "On the in-place accumulation path each micro-batch's loss must be weighted by the accumulator before "
                "its backward: back-propagate `accumulator.loss_to_backward(loss)` (or call `accumulator.backward(loss, "
                "num_items=...)`), not `loss.backward()`. This window was discarded. To use `loss.backward()` "
                "itself, build the accumulator with `accumulation_path='hooks'`."
            )
        self._in_place_state = self.buffers.fingerprint()

    def _check_in_place_unchanged(self) -> None:
        """Between micro-batches nothing but the accumulator may change `.grad`, which holds the window's sum so far:
        a backward of a loss that did not pass through it (unweighted), or a `zero_grad()` (the micro-batches before
        it lost). Either changes a gradient's identity or version counter; refused, the window discarded."""
        if self._in_place_state is not None and self.buffers.fingerprint() != self._in_place_state:
            self.discard_window()
            raise RuntimeError(
                "A parameter's `.grad` changed between the accumulator's micro-batches: a backward of a loss that did "
                "not pass through the accumulator (call `accumulator.backward(loss)` or `accumulate_micro_batch` "
                "instead of `loss.backward()`), or a `zero_grad()` between micro-batches (leave it to "
                "`accumulator.step`, which calls it after the optimizer step). On the in-place path `.grad` holds the "
                "window's sum, so this window was discarded; `accumulation_path='hooks'` tolerates neither silently "
                "either, but folds each micro-batch as it arrives."
            )

    def _flush_fsdp_schedule(self) -> None:
        """FSDP2 `once_per_window`: reduce-scatter gradients FSDP2 still holds unsynced (a partial window, or a
        skipped last micro-batch) into the buffer, at the window's (constant: no recompute) scale."""
        if self.fsdp_schedule is not None and self.fsdp_schedule.pending:
            self._fold_alpha = 1.0 / self.current_scale
            try:
                self.fsdp_schedule.flush()
            finally:
                self._fold_alpha = None

    def _update_loss_scale(self, skip_reason: str | None, any_backoff: bool, min_scale: float) -> None:
        """One decision for all ranks: every rank ends the window with the smallest scale any rank backed off to
        (a rank that recomputed a micro-batch backed off alone), and grows only after windows clean everywhere."""
        scaler = self.loss_scaler
        scaler.scale = min_scale
        if skip_reason in ("overflow", "non_finite_grad"):
            scaler.update(found_inf=True)
        elif any_backoff:
            scaler.growth_tracker = 0
        elif skip_reason is None:
            scaler.update(found_inf=False)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None = None,
        *,
        max_grad_norm: float | None = None,
    ) -> WindowResult:
        """
        [`finish_window`], then (only if the window was applied) clip to `max_grad_norm`, `optimizer.step()` and
        `lr_scheduler.step()`; finally `optimizer.zero_grad(set_to_none=True)`. Skipped windows leave the optimizer,
        its state and the scheduler untouched. After the loop, [`flush`] steps on a partial last window, if any.
        """
        clip = max_grad_norm is not None and max_grad_norm > 0
        result = self.finish_window(max_grad_norm=max_grad_norm if clip else None)
        if result.applied:
            optimizer.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return result

    def flush(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None = None,
        *,
        max_grad_norm: float | None = None,
    ) -> WindowResult | None:
        """
        After the training loop: [`step`] on the partial window still pending (fewer than
        `gradient_accumulation_steps` micro-batches, when the loader's length is not a multiple of it), or nothing
        when no micro-batch is pending. The partial window's update is the large-batch step on its own samples.
        Because it is a no-op after a full window, the loop needs no `len()` of the loader to find its last
        micro-batch.

        Returns:
            [`WindowResult`] of the flushed window, or `None` when there was nothing to flush.

        Example:

        ```python
        >>> import torch
        >>> from hf_gradaccum import GradientAccumulator
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> accumulator = GradientAccumulator(model, gradient_accumulation_steps=4)
        >>> for x in (torch.randn(2, 2) for _ in range(3)):  # 3 micro-batches: the window is never full
        ...     accumulator.backward(model(x).pow(2).mean(), num_items=2)
        ...     if accumulator.sync_gradients:
        ...         accumulator.step(optimizer)
        >>> accumulator.flush(optimizer).micro_steps
        3
        >>> accumulator.flush(optimizer) is None  # nothing pending any more
        True
        ```
        """
        if self.micro_steps_in_window == 0:
            return None
        return self.step(optimizer, lr_scheduler, max_grad_norm=max_grad_norm)

    # ------------------------------------------------------------------ state
    def metrics(self) -> dict[str, float]:
        """Counters for logging: applied and skipped steps (by reason), recomputed micro-batches, loss scale."""
        logs = {
            "accumulator/applied_steps": float(self.applied_steps),
            "accumulator/skipped_steps": float(sum(self.skipped_steps.values())),
            "accumulator/recomputed_micro_batches": float(self.recomputed_micro_batches),
        }
        for reason, count in self.skipped_steps.items():
            logs[f"accumulator/skipped_{reason}"] = float(count)
        if self.loss_scaler is not None:
            logs["accumulator/loss_scale"] = float(self.loss_scaler.scale)
        return logs

    def state_dict(self) -> dict[str, Any]:
        """
        Everything needed to resume exactly: counters, the loss scaler, and (mid-window only) the buffers and the
        window's item and loss sums.
        """
        state: dict[str, Any] = {
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "accumulation_dtype": str(self.accumulation_dtype).removeprefix("torch."),
            "micro_step": self.micro_step,
            "applied_steps": self.applied_steps,
            "skipped_steps": dict(self.skipped_steps),
            "recomputed_micro_batches": self.recomputed_micro_batches,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "window": None,
        }
        if self._window is not None and self._window.micro_steps > 0:
            # FSDP2 `once_per_window`: gradients FSDP2 holds unsynced go into the buffer first (a collective).
            self._flush_fsdp_schedule()
            state["window"] = {**self._window.state_dict(), "buffers": self.buffers.snapshot()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore [`state_dict`]. A mid-window state saved with different accumulation steps is refused."""
        window = state.get("window")
        if window is not None and state["gradient_accumulation_steps"] != self.gradient_accumulation_steps:
            raise ValueError(
                "Cannot resume mid-window: the checkpoint was saved with `gradient_accumulation_steps="
                f"{state['gradient_accumulation_steps']}` but this run uses {self.gradient_accumulation_steps}."
            )
        if state["gradient_accumulation_steps"] != self.gradient_accumulation_steps:
            logger.warning(
                "Resuming with gradient_accumulation_steps=%d (checkpoint: %d).",
                self.gradient_accumulation_steps,
                state["gradient_accumulation_steps"],
            )
        self.micro_step = state["micro_step"]
        self.applied_steps = state["applied_steps"]
        self.skipped_steps = Counter(state["skipped_steps"])
        self.recomputed_micro_batches = state["recomputed_micro_batches"]
        if state.get("loss_scaler") is not None:
            if self.loss_scaler is None:
                raise ValueError("The checkpoint has loss-scaler state but this accumulator has no `loss_scaler`.")
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self._window = None
        self._zero_item_backwards = 0
        # FSDP2 `once_per_window`: unsynced gradients of the abandoned window must not reach the restored one.
        if self.fsdp_schedule is not None:
            self.fsdp_schedule.discard()
        if window is not None:
            self._start_window()
            self.buffers.restore(window["buffers"])
            self._window.load_state_dict(window)
            if self.in_place:
                self._in_place_state = self.buffers.fingerprint()

    def remove_hooks(self) -> None:
        """Detach the accumulator from the model; `.grad` behaves as plain PyTorch again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.buffers.close()
