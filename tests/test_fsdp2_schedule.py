"""FSDP2 `fsdp_reduce_schedule="once_per_window"`: one reduce-scatter per window (FSDP2 accumulates unsharded
gradients under `set_requires_gradient_sync(False)`), still equal to the hand-computed large-batch step, on real gloo
CPU processes; and the combinations it refuses because they could not be exact."""

import json
from pathlib import Path

import pytest
import torch

from hf_gradaccum import GradientAccumulator
from tests.test_fsdp2 import RTOL, spawn
from tests.torch_features import needs_fsdp2_torch, needs_once_per_window_internals

pytestmark = needs_fsdp2_torch


def run_schedule(world_size: int, tmp_path: Path) -> dict:
    out = tmp_path / f"schedule_{world_size}.json"
    spawn("fsdp2_schedule", world_size, out)
    return json.loads(out.read_text())


def check(record: dict) -> None:
    # 3 windows of 3, 3 and 2 (partial) uneven micro-batches, different token counts per rank, clipping in window 2.
    assert record["relative_update_error"] <= RTOL, record
    assert record["every_micro_batch_relative_update_error"] <= RTOL, record
    # The schedule is in effect: FSDP2 calls the sharded parameter's hook after each reduce-scatter, so once per
    # window (the partial window's through the flush at `finish_window`) against once per micro-batch.
    assert record["once"]["hooks_per_window"] == [1, 1, 1]
    assert record["every"]["hooks_per_window"] == [3, 3, 2]
    # Between micro-batches FSDP2 holds the full model's unsharded fp32 gradient on every rank; none is left over.
    assert record["once"]["unsharded_bytes_after_first_micro_batch"] == [4 * record["full_numel"]] * 3
    assert record["once"]["unsharded_bytes_after_training"] == 0
    # A NaN loss in the last micro-batch on one rank: the window is skipped on every rank, and the gradients FSDP2
    # had accumulated from its earlier micro-batches do not leak into the next window.
    assert record["nan"]["applied"] == [True, False, True, True]
    assert record["nan"]["skipped"] == {"non_finite_loss": 1}
    assert record["nan_window_vs_once_max_abs_diff"] == 0.0
    # `state_dict()` mid-window first reduce-scatters what FSDP2 holds unsynced into the buffer it saves (a second
    # reduce-scatter in that window), and training goes on exactly.
    assert record["saved"]["saved_buffer_norm"] > 0
    assert record["saved"]["hooks_per_window"] == [2, 1, 1]
    assert record["saved_mid_window_relative_update_error"] <= RTOL, record


@needs_once_per_window_internals
def test_once_per_window_two_processes_match_large_batch(tmp_path):
    record = run_schedule(2, tmp_path)
    check(record)
    refusals = record["refusals"]
    for case in ("bf16_params_no_reduce_dtype", "bf16_model_no_policy"):
        assert "would accumulate unsharded gradients in bfloat16" in refusals[case]
        assert "reduce_dtype=torch.float32" in refusals[case]
    assert "cannot be combined with fp16 `overflow_policy='recompute'`" in refusals["fp16_recompute"]
    assert refusals["fp16_skip"] is None


@pytest.mark.slow
def test_once_per_window_four_processes_match_large_batch(tmp_path):
    check(run_schedule(4, tmp_path))


@pytest.mark.slow
def test_once_per_window_bf16_params_fp32_reduce_stay_at_one_pass_floor(tmp_path):
    """bf16 parameters, fp32 reduce: FSDP2 accumulates the no-sync gradients in the reduce dtype (fp32), so 64
    micro-batches stay within 1.25x the error of one pass over the same samples (both vs fp64)."""
    out = tmp_path / "mixed.json"
    spawn("fsdp2_mixed", 2, out, "once_per_window")
    record = json.loads(out.read_text())
    assert record["schedule"] == "once_per_window"
    assert record["accumulated_error"] <= 1.25 * record["one_pass_error"], record


def test_unknown_schedule_is_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match=r"`fsdp_reduce_schedule` must be one of \('every_micro_batch', 'once_per"):
        GradientAccumulator(torch.nn.Linear(2, 2), fsdp_reduce_schedule="sometimes")


def test_once_per_window_needs_an_fsdp2_model():
    with pytest.raises(ValueError, match="needs a model sharded with FSDP2"):
        GradientAccumulator(torch.nn.Linear(2, 2), fsdp_reduce_schedule="once_per_window")


def test_trainer_arguments_refuse_an_unknown_schedule_before_training():
    from hf_gradaccum import GradAccumArguments

    with pytest.raises(ValueError, match=r"`fsdp_reduce_schedule` must be one of \('every_micro_batch', 'once_per"):
        GradAccumArguments("out", use_cpu=True, report_to=[], fsdp_reduce_schedule="sometimes")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({}, "needs FSDP2"),  # one CPU process: nothing is sharded
        ({"fp16": True}, "needs FSDP2"),
    ],
)
def test_trainer_refuses_once_per_window_without_fsdp2_at_construction(overrides, message):
    from hf_gradaccum import GradAccumArguments, GradAccumTrainer
    from tests.parity_cases import CASES

    case = next(c for c in CASES if c.name == "bert_seq_cls")
    args = GradAccumArguments(
        "out", use_cpu=True, report_to=[], fsdp_reduce_schedule="once_per_window", save_strategy="no", **overrides
    )
    with pytest.raises(ValueError, match=message):
        GradAccumTrainer(model=case.make_model(), args=args, train_dataset=case.make_data(4, torch.Generator()))


def test_once_per_window_with_fp16_recompute_is_refused_with_the_fix():
    from types import SimpleNamespace

    from hf_gradaccum.distributed.sharding import _check_reduce_schedule

    args = SimpleNamespace(fsdp_reduce_schedule="once_per_window", fp16=True, overflow_policy="recompute")
    with pytest.raises(ValueError, match="needs `overflow_policy='skip'`"):
        _check_reduce_schedule(args, fsdp2=True)
    _check_reduce_schedule(
        SimpleNamespace(fsdp_reduce_schedule="once_per_window", fp16=True, overflow_policy="skip"), True
    )
