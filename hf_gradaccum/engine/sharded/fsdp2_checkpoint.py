"""`AccumulatorCheckpoint`: the state of a [`GradientAccumulator`] on an FSDP2 model, for
`torch.distributed.checkpoint`.

A mid-window checkpoint must hold the partial sums of the window. Under FSDP2 they are sharded like the parameters
(`ShardedGradientBuffers`), so they are saved the way FSDP2 saves parameters: as `DTensor`s, one shard written per
rank by `torch.distributed.checkpoint` (DCP), with no format of our own. Everything else (counters, the loss scaler,
the window's running totals) is small; the totals differ between ranks (each rank counts its own items and loss), so
they are gathered once at save time into one object that every rank holds identically, and DCP writes it once.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..accumulator import GradientAccumulator
from ..reduction import world_size_and_rank
from .fsdp2_buffers import ShardedGradientBuffers, is_dtensor

BUFFERS_KEY = "buffers"
META_KEY = "meta"


class AccumulatorCheckpoint:
    """
    A `torch.distributed.checkpoint` `Stateful` for a [`GradientAccumulator`] on an FSDP2 (`fully_shard`) model.
    Save and load it next to the model and optimizer state from
    `torch.distributed.checkpoint.state_dict.get_state_dict`; a checkpoint taken in the middle of a window resumes
    bitwise, on the same number of ranks, with the same `gradient_accumulation_steps` (a different value is
    refused by [`GradientAccumulator.load_state_dict`]).

    Saves: the sharded fp32 buffers (a `DTensor` per parameter; always present, so that a fresh accumulator's state
    is a valid `dcp.load` template, and ignored on load when saved at a window boundary), the counters, the loss
    scaler's state (scale, growth tracker) and each rank's window totals. `dcp.save` and `dcp.load` are collectives:
    call them on every rank. While the state dict is alive it holds one extra copy of this rank's buffer shard on
    its device.

    Args:
        accumulator ([`GradientAccumulator`]): an accumulator built on an FSDP2 model (`accumulator.sharded`).
            Accumulators on replicated models (one process, DDP) are refused: use `accumulator.state_dict()` with
            `torch.save`, one file per rank, as `GradAccumTrainer` does.

    Example (on every rank of an FSDP2 run; see docs/fsdp2.md):

    ```python
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from hf_gradaccum import AccumulatorCheckpoint

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "accumulator": AccumulatorCheckpoint(accumulator)}
    dcp.save(state, checkpoint_id="ckpt/micro-4")  # may be in the middle of a window

    # resume: build the sharded model, optimizer and accumulator as before, then
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "accumulator": AccumulatorCheckpoint(accumulator)}
    dcp.load(state, checkpoint_id="ckpt/micro-4")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # continue the data at micro-batch `accumulator.micro_step`
    ```
    """

    def __init__(self, accumulator: GradientAccumulator) -> None:
        if not isinstance(accumulator, GradientAccumulator):
            raise TypeError(f"`accumulator` must be a GradientAccumulator, got {type(accumulator).__name__}.")
        if not (accumulator.sharded and isinstance(accumulator.buffers, ShardedGradientBuffers)):
            raise ValueError(
                "`AccumulatorCheckpoint` is for a GradientAccumulator on an FSDP2 (`fully_shard`) model, whose "
                "buffers are sharded; this accumulator's buffers are replicated (one process or DDP). Save "
                "`accumulator.state_dict()` with `torch.save`, one file per rank, instead."
            )
        if not all(is_dtensor(p) for p in accumulator.parameters):
            # A plain parameter's buffer slice differs per rank, and DCP would write it once as if replicated.
            raise ValueError(
                "`AccumulatorCheckpoint` needs every trainable parameter sharded by FSDP2: some are plain tensors. "
                "Apply `fully_shard` to the root module as well, so it owns the remaining parameters."
            )
        self.accumulator = accumulator

    def state_dict(self) -> dict[str, Any]:
        """The buffers as per-parameter `DTensor`s and one pickled object with everything else (the template for
        `dcp.load` as well: a fresh accumulator's buffers are zeros of the right layout)."""
        acc = self.accumulator
        state = acc.state_dict()
        window = state.pop("window")
        buffers = window.pop("buffers") if window is not None else acc.buffers.snapshot()
        world, rank = world_size_and_rank(None)
        windows: list[Any] = [None] * world
        if world > 1:
            # The window totals (items, loss sum, touched parameters) are per rank; everything else is the same on
            # every rank. Gathered, the object is identical everywhere, so DCP writes it once for all ranks.
            torch.distributed.all_gather_object(windows, window)
        else:
            windows[rank] = window
        meta = io.BytesIO()
        torch.save({**state, "world_size": world, "windows": windows}, meta)
        return {BUFFERS_KEY: {str(i): b for i, b in enumerate(buffers)}, META_KEY: meta.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`] saved, after `dcp.load` filled the buffers' shards in place."""
        meta = torch.load(io.BytesIO(state[META_KEY]), weights_only=True)  # plain values and CPU tensors only
        world, rank = world_size_and_rank(None)
        windows = meta.pop("windows")
        saved_world = meta.pop("world_size")
        window = windows[rank] if saved_world == world else None
        if saved_world != world and any(w is not None for w in windows):
            raise ValueError(
                f"Cannot resume mid-window on {world} process(es): the checkpoint was saved in the middle of a window "
                f"on {saved_world} process(es), and each rank's partial window belongs to its own data shard. Resume "
                "on the same number of processes, or from a checkpoint taken at a window boundary."
            )
        buffers = state[BUFFERS_KEY]
        if window is not None:
            window["buffers"] = [buffers[str(i)] for i in range(len(buffers))]
        self.accumulator.load_state_dict({**meta, "window": window})
