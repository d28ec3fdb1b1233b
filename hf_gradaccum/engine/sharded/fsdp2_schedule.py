"""When FSDP2 reduce-scatters during a window: at every micro-batch (default) or once per window.

`"every_micro_batch"`: FSDP2 reduce-scatters each backward and the accumulator folds the local shard into its sharded
fp32 buffer. Only shards ever exist, so the memory is 1/world_size of the model's gradients.

`"once_per_window"`: the accumulator calls `set_requires_gradient_sync(False)` on the FSDP2 modules for every
micro-batch but the window's last. FSDP2 then keeps the *unsharded* gradient between micro-batches and
reduce-scatters once, so a window costs one reduce-scatter instead of `gradient_accumulation_steps`, at the price of
one full-model unsharded gradient on every rank. What torch 2.13's FSDP2 does under no-sync (read from
`_fsdp_param_group.post_backward` and `_fsdp_param.py`):

- the accumulated gradient lives in the **reduce dtype** when `MixedPrecisionPolicy.reduce_dtype` differs from the
  compute dtype (`to_accumulated_grad_if_needed` casts the first micro-batch's gradient into
  `unsharded_accumulated_grad`, later ones are added to it), otherwise in the **compute dtype** (autograd's own `.grad`
  accumulation on the unsharded parameter). bf16/fp16 accumulation would round at every micro-batch, so it is refused;
- the post-accumulate-grad hook of the sharded parameter is called by FSDP2 itself after the reduce-scatter
  (`foreach_reduce`), so it does **not** fire on no-sync micro-batches: nothing reaches the accumulator's buffer until
  the synced backward;
- a micro-batch cannot be taken back out of FSDP2's accumulated gradient, so fp16 `overflow_policy="recompute"` is
  refused (use `"skip"` or the default schedule);
- a partial window (its last micro-batch was not known to be the last) leaves gradients unreduced: [`flush`] runs
  FSDP2's own post-backward with gradient sync on, which reduce-scatters them and calls the hook, exactly as the
  synced backward would have.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .fsdp2_buffers import fsdp2_modules

FSDP_REDUCE_SCHEDULES = ("every_micro_batch", "once_per_window")


def check_fsdp_reduce_schedule(schedule: str) -> str:
    """Return `schedule` if it is one of [`FSDP_REDUCE_SCHEDULES`]; otherwise a `ValueError` listing them."""
    if schedule not in FSDP_REDUCE_SCHEDULES:
        raise ValueError(f"`fsdp_reduce_schedule` must be one of {FSDP_REDUCE_SCHEDULES}, got {schedule!r}.")
    return schedule


def _param_groups(modules: list[nn.Module]) -> Iterator:
    """FSDP2's parameter groups, in module order (the same on every rank, so their collectives pair up)."""
    for module in modules:
        state = module._get_fsdp_state()
        if hasattr(state, "_fsdp_param_groups"):
            yield from state._fsdp_param_groups
        elif state._fsdp_param_group is not None:  # older torch (2.11) keeps at most one group per module
            yield state._fsdp_param_group


def _pop_reduce_scatter_states(comm_ctx: object) -> list:
    """The reduce-scatters still in flight, taken out of FSDP2's communication context: a list in newer torch, a single
    optional `reduce_scatter_state` in older releases (torch 2.11)."""
    if hasattr(comm_ctx, "reduce_scatter_states"):
        states = list(comm_ctx.reduce_scatter_states)
        comm_ctx.reduce_scatter_states.clear()
        return states
    state = getattr(comm_ctx, "reduce_scatter_state", None)  # unset before FSDP2's lazy init
    if state is not None:
        comm_ctx.reduce_scatter_state = None
    return [] if state is None else [state]


def no_sync_accumulation_dtypes(model: nn.Module, modules: list[nn.Module]) -> dict[str, torch.dtype]:
    """
    The dtype FSDP2 accumulates each trainable parameter's unsharded gradient in between no-sync micro-batches: the
    reduce dtype if it differs from the compute dtype (FSDP2 casts into it), else the compute dtype (param dtype,
    or the sharded parameter's own dtype without mixed precision). Computed from the policy as
    `FSDPParam.init_dtype_attrs` does, since FSDP2 fills those attributes only at its lazy init (first forward).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    dtypes = {}
    for group in _param_groups(modules):
        policy = group.mp_policy
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            if not param.requires_grad:
                continue
            reduce_dtype = None if policy.reduce_dtype == policy.param_dtype else policy.reduce_dtype
            compute = param.dtype if policy.param_dtype in (None, param.dtype) else policy.param_dtype
            dtypes[names.get(id(param), str(tuple(param.shape)))] = reduce_dtype or compute
    return dtypes


class OncePerWindow:
    """
    `"once_per_window"`: no gradient sync until the window's last micro-batch, one reduce-scatter per window.

    Args:
        model (`nn.Module`): the FSDP2 model (`fully_shard` applied).
        loss_scaled (`bool`): whether fp16 dynamic loss scaling is on.
        overflow_policy (`str`): the accumulator's fp16 overflow policy; `"recompute"` is refused with loss scaling.

    Raises:
        `ValueError`: no FSDP2 module in `model`; a no-sync accumulation dtype below fp32; fp16 recompute.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.fsdp2_schedule import OncePerWindow
    >>> OncePerWindow(torch.nn.Linear(2, 2), loss_scaled=False, overflow_policy="recompute")
    Traceback (most recent call last):
    ...
    ValueError: `fsdp_reduce_schedule='once_per_window'` needs a model sharded with FSDP2 (`fully_shard`); ...
    ```
    """

    name = "once_per_window"
    pending = False
    """Whether FSDP2 holds gradients it has not reduce-scattered yet (they are not in the accumulator's buffer)."""

    def __init__(self, model: nn.Module, *, loss_scaled: bool, overflow_policy: str) -> None:
        self.modules = fsdp2_modules(model) if isinstance(model, nn.Module) else []
        if not self.modules:
            raise ValueError(
                "`fsdp_reduce_schedule='once_per_window'` needs a model sharded with FSDP2 (`fully_shard`); "
                "pass the module itself. Without FSDP2 the accumulator already reduces once per window."
            )
        try:
            # The flush at a partial window's end drives FSDP2's own post-backward: private API, read from torch 2.13.
            from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # noqa: F401

            for group in _param_groups(self.modules):
                group.post_backward, group.finalize_backward  # noqa: B018 (AttributeError if torch changed them)
            accumulation_dtypes = no_sync_accumulation_dtypes(model, self.modules)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                "`fsdp_reduce_schedule='once_per_window'` relies on FSDP2 internals that this torch "
                f"({torch.__version__}) does not have (read from torch 2.11 and 2.13) ({error!r}). Use "
                "`fsdp_reduce_schedule='every_micro_batch'`, which needs only FSDP2's public API."
            ) from error
        inexact = {name: dtype for name, dtype in accumulation_dtypes.items() if dtype.itemsize < 4}
        if inexact:
            name, dtype = next(iter(inexact.items()))
            raise ValueError(
                "`fsdp_reduce_schedule='once_per_window'` would accumulate unsharded gradients in "
                f"{str(dtype).removeprefix('torch.')} (e.g. `{name}`): FSDP2 keeps them in the reduce dtype, or the "
                "param dtype when `reduce_dtype` is unset, and that rounds at every micro-batch. Use "
                "`MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)` or "
                "`fsdp_reduce_schedule='every_micro_batch'` (each micro-batch reduce-scattered into the fp32 buffer)."
            )
        if loss_scaled and overflow_policy == "recompute":
            raise ValueError(
                "`fsdp_reduce_schedule='once_per_window'` cannot be combined with fp16 `overflow_policy='recompute'`: "
                "FSDP2 sums the window's unsharded gradients itself, so one overflowing micro-batch cannot be taken "
                "back out. Use `overflow_policy='skip'` or `fsdp_reduce_schedule='every_micro_batch'`."
            )
        self.pending = False

    def _set_sync(self, sync: bool) -> None:
        for module in self.modules:
            module.set_requires_gradient_sync(sync, recurse=False)

    def before_backward(self, last_in_window: bool) -> None:
        """Called right before each micro-batch's backward: sync only on the window's last."""
        self._set_sync(last_in_window)
        self.pending = not last_in_window

    def flush(self) -> None:
        """
        What FSDP2's root post-backward callback does for a group that did not run backward, with sync on: every
        group reduce-scatters its accumulated unsharded gradients and FSDP2 calls the sharded parameters'
        post-accumulate-grad hooks. A collective: every rank calls it at the same point (the window's end).
        """
        if not self.pending:
            return
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self._set_sync(True)
        groups = list(_param_groups(self.modules))
        # Reverse order, like autograd's backward and FSDP2's final callback.
        for group in reversed(groups):
            group.post_backward()
            group._training_state = TrainingState.IDLE
        for group in groups:
            group.finalize_backward()
        for module in self.modules:
            state = module._get_fsdp_state()
            for rs_state in _pop_reduce_scatter_states(state._comm_ctx):
                if rs_state.event is not None:
                    state._device_handle.current_stream().wait_event(rs_state.event)
        self.pending = False

    def discard(self) -> None:
        """Drop FSDP2's accumulated unsharded gradients (a local operation, no collective)."""
        for group in _param_groups(self.modules):
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                fsdp_param._unsharded_param.grad = None
        self._set_sync(True)
        self.pending = False

    def unsharded_gradient_bytes(self) -> int:
        """Bytes of unsharded gradients FSDP2 holds right now on this rank (what this schedule costs in memory)."""
        total = 0
        for group in _param_groups(self.modules):
            for fsdp_param in group.fsdp_params:
                for grad in (fsdp_param.unsharded_accumulated_grad, fsdp_param._unsharded_param.grad):
                    if grad is not None:
                        local = grad.to_local() if hasattr(grad, "to_local") else grad
                        total += local.untyped_storage().nbytes()
        return total


def make_fsdp_reduce_schedule(
    schedule: str, model: object, *, sharded: bool, loss_scaled: bool, overflow_policy: str
) -> OncePerWindow | None:
    """
    The schedule object for `GradientAccumulator(fsdp_reduce_schedule=...)`: `None` for the default
    `"every_micro_batch"` (FSDP2 reduce-scatters every backward; nothing to schedule), an [`OncePerWindow`] otherwise.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.fsdp2_schedule import make_fsdp_reduce_schedule
    >>> make_fsdp_reduce_schedule(
    ...     "every_micro_batch", torch.nn.Linear(2, 2), sharded=False, loss_scaled=False, overflow_policy="skip"
    ... ) is None
    True
    ```
    """
    check_fsdp_reduce_schedule(schedule)
    if schedule == "every_micro_batch":
        return None
    if not sharded:
        model = None  # no DTensor parameters: refused below with the message that says why
    return OncePerWindow(model, loss_scaled=loss_scaled, overflow_policy=overflow_policy)
