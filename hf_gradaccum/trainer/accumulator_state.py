"""The accumulator's state in every Trainer checkpoint (`accumulator_state.pt`, beside the model) and back on resume:
the loss scale and counters, the effective batch the run trained with, the out-of-memory chunking, and the run's
batch layout (`effective_batch_size`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import get_last_checkpoint

from ..config.arguments import gradaccum_option
from ..engine.accumulator import GradientAccumulator
from ..helpers.lr_scaling import effective_batch_size

ACCUMULATOR_STATE_NAME = "accumulator_state.pt"

logger = logging.getLogger(__name__)


def trainer_effective_batch_size(trainer: Any) -> int:
    """The effective batch `trainer` trains with: the run's batch, or micro-batch x steps x processes."""
    if trainer._run_batch is not None:
        return trainer._run_batch.effective_batch_size
    args = trainer.args
    return effective_batch_size(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size)


def resume_state_path(trainer: Any, resume_from_checkpoint: str | bool | None) -> tuple[str | None, str | None]:
    """The checkpoint `train(resume_from_checkpoint)` resumes from (`True` resolved as the Trainer resolves it), and
    its accumulator state file where it has one."""
    path = resume_from_checkpoint
    if path is True:
        # The parent resolves `True` itself (and raises "No valid checkpoint found" when there is none).
        output_dir = trainer.args.output_dir
        path = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    state_file = os.path.join(path, ACCUMULATOR_STATE_NAME) if isinstance(path, str) else None
    return path, (state_file if state_file and os.path.isfile(state_file) else None)


def save_accumulator_state(trainer: Any, output_dir: str) -> None:
    """Write `trainer`'s accumulator state into the checkpoint folder `output_dir`, atomically."""
    state = {
        "accumulator": trainer.accumulator.state_dict(),
        "effective_batch_size": trainer_effective_batch_size(trainer),
        "micro_batch_size": trainer._train_batch_size,
        "micro_batch_chunk_size": trainer.micro_batch_chunk_size,
        "run_batch": None if trainer._run_batch is None else trainer._run_batch.state(),
    }
    # Under FSDP2 with sharded state dicts, `save_model` writes nothing itself (Accelerate's DCP files come later, with
    # the optimizer), so the directory may not exist yet.
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, ACCUMULATOR_STATE_NAME + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(output_dir, ACCUMULATOR_STATE_NAME))  # never a half-written file


def load_accumulator_state(trainer: Any, acc: GradientAccumulator, path: str) -> None:
    """Restore `acc` from the state file `path`; warn (or, with `refuse_resume_with_different_batch`, refuse) when
    the checkpoint trained with another effective batch."""
    state = torch.load(path, weights_only=False)
    saved, now = state["effective_batch_size"], trainer_effective_batch_size(trainer)
    if saved != now:
        message = (
            f"Resuming from {os.path.dirname(path)}, trained with an effective batch of {saved} (micro-batch x "
            f"gradient_accumulation_steps x world_size); this run uses {now}."
        )
        if gradaccum_option(trainer.args, "refuse_resume_with_different_batch"):
            raise ValueError(message + " Resume with the same effective batch, or start a new run.")
        logger.warning(message)
    accumulator_state = dict(state["accumulator"])
    if accumulator_state.get("window") is not None:
        # Trainer checkpoints are written at optimizer-step boundaries, so this comes from a plain-loop save: its
        # half-accumulated window belongs to data this run will not replay.
        logger.warning("The checkpoint holds a partly accumulated window; it is discarded.")
        accumulator_state["window"] = None
    if accumulator_state.get("loss_scaler") is not None and acc.loss_scaler is None:
        accumulator_state["loss_scaler"] = None  # resumed without fp16: the loss scale is not needed
    accumulator_state["gradient_accumulation_steps"] = acc.gradient_accumulation_steps
    acc.load_state_dict(accumulator_state)
    if state.get("micro_batch_size") in (None, trainer._train_batch_size):
        trainer.oom_retry.chunk_size = state.get("micro_batch_chunk_size")
    logger.info("Restored accumulator state from %s: %s", path, acc.metrics())
