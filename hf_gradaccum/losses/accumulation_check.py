"""`verify_accumulation` in `GradAccumTrainer`: the split-invariance check on a real training window.

Runs on the window the Trainer has just prefetched, with the trainer's own `compute_loss` (so a composed TRL/Seq2Seq
trainer's loss is what is checked) and its `count_micro_batch_items`. Under DDP each rank checks its own window on
the unwrapped model (no DDP reducer involved), and the largest relative difference is all-reduced so that every rank
reaches the same verdict and none of them stops alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config.arguments import gradaccum_option
from ..verification import SplitInvarianceResult, verify_split_invariance

CHECK_FILE_NAME = "accumulation_check.json"
VERDICTS = ("exact", "cannot_decide", "not_exact")  # ordered: the MAX over ranks is the global verdict
VERDICT_CODES = {verdict: float(code) for code, verdict in enumerate(VERDICTS)}
logger = logging.getLogger(__name__)


class AccumulationNotExactError(RuntimeError):
    """Raised with `verify_raise=True` when accumulation is not exact for the model being trained."""


def should_verify(trainer: Any) -> bool:
    """Whether the window about to be trained is checked, from `verify_accumulation` and the global step."""
    mode = gradaccum_option(trainer.args, "verify_accumulation")
    if mode == "first_step":
        return not getattr(trainer, "_accumulation_verified", False)
    if mode == "every_n_steps":
        every = gradaccum_option(trainer.args, "verify_every_n_steps")
        return trainer.state.global_step % every == 0 and getattr(trainer, "_verified_at", None) != (
            trainer.state.global_step
        )
    return False


def _verdict(result: SplitInvarianceResult) -> str:
    return getattr(result, "verdict", None) or ("exact" if result.passed else "not_exact")


def _autocast_dtype(args: Any) -> torch.dtype | None:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def check_trainer_window(
    trainer: Any,
    batches: list[dict[str, Any]],
    probe: Callable[[torch.nn.Module, list[dict[str, Any]]], SplitInvarianceResult] | None = None,
    refuse: Callable[[str], Exception] | None = None,
) -> SplitInvarianceResult | None:
    """
    Run the check on `batches` (one window) for `trainer`; log, write the JSON, warn or raise. Returns the local
    result with the global verdict (`passed`, `max_rel_diff` all-reduced over ranks), or `None` if the window could
    not be checked (too small; the reason is logged). `probe(model, prepared_batches)` replaces the ordinary
    split-invariance check (the coupled-loss trainer passes its own). `refuse(finding)` returns the error raised when
    the window is found not exact or cannot be checked, whatever `verify_raise` says (an unknown composition is
    checked that way: what cannot be shown exact does not train).
    """
    trainer._accumulation_verified = True
    trainer._verified_at = trainer.state.global_step
    # `trainer.model` is the module under DDP (shared parameters): no reducer sees the probe.
    model = trainer.model

    def loss_fn(module: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(module, batch)

    result, error = None, None
    try:
        prepared = [trainer._prepare_inputs(b) for b in batches]
        result = (
            probe(model, prepared)
            if probe is not None
            else verify_split_invariance(
                model,
                prepared,
                loss_fn=loss_fn,
                count_items=trainer.count_micro_batch_items,
                dtype=_autocast_dtype(trainer.args),
            )
        )
    except (ValueError, TypeError) as e:  # a window that cannot be split: report, do not stop training
        error = e
    except Exception as e:
        # An unknown composition stops on whatever the check met (named, with the fix), never a stray traceback.
        if refuse is None:
            raise
        error = RuntimeError(f"{type(e).__name__}: {e}")
    # [max relative difference, verdict code, any rank could not check]: MAX over ranks, so all ranks agree on the
    # verdict: one rank's "not exact" outweighs another's "cannot decide", which outweighs "exact".
    local_diff = result.max_rel_diff if result is not None else 0.0
    local_diff = local_diff if local_diff is not None and math.isfinite(local_diff) else 0.0
    local = torch.tensor(
        [local_diff, VERDICT_CODES[_verdict(result)] if result else 0.0, 1.0 if error else 0.0],
        dtype=torch.float64,
        device=trainer.args.device,
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    global_max, verdict, any_error = float(local[0]), VERDICTS[int(local[1])], bool(local[2])
    if any_error:
        if refuse is not None:
            raise refuse(f"The check could not run on this window: {error}")
        logger.warning("verify_accumulation: the window could not be checked on every rank (%s); skipped.", error)
        return None
    if global_max > 0 or (result.max_rel_diff is not None and math.isfinite(result.max_rel_diff)):
        result.max_rel_diff = global_max  # else: decided by inspection alone (BatchNorm), nothing was compared
    result.verdict = verdict
    result.passed = verdict == "exact"
    trainer.log({"accumulator/verify_rel_diff": global_max})
    record = {"global_step": trainer.state.global_step, "world_size": trainer.args.world_size, **result.to_dict()}
    finding = getattr(getattr(trainer, "_loss_rule", None), "finding", None)
    if finding is not None:  # written on the first window, before this check: kept in the same file
        record["loss_normalisation"] = finding.to_dict()
    if trainer.is_world_process_zero():
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        with open(os.path.join(trainer.args.output_dir, CHECK_FILE_NAME), "w") as f:
            json.dump(record, f, indent=2)
    if result.passed:
        logger.info("verify_accumulation: %s", result.summary())
        return result
    if verdict == "cannot_decide" and refuse is not None:
        # An unknown composition trains only when shown exact: undecided (e.g. its loss raised on a split) stops it,
        # saying so, rather than training what the check could not run or failing later with a bare traceback.
        raise refuse(f"The check could not decide on this window.\n{result.summary()}")
    if verdict == "cannot_decide":
        # Never a false alarm: a check that cannot tell (randomness it could not switch off, a forward that failed on
        # a split) says so and never stops training, even with `verify_raise=True`.
        logger.warning("verify_accumulation cannot decide whether accumulation is exact here.\n%s", result.summary())
        return result
    message = (
        "Gradient accumulation is NOT exact for this model: the same window split differently gives a different "
        f"gradient, so training differs from the large batch.\n{result.summary()}"
    )
    if result.diagnosis is None:
        message += "\n(this rank's window passed; another rank's did not, see its log)"
    if refuse is not None:
        raise refuse(result.summary())
    if gradaccum_option(trainer.args, "verify_raise"):
        raise AccumulationNotExactError(message)
    logger.warning(message)
    return result
