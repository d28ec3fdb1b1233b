"""FSDP2 checkpoints with `torch.distributed.checkpoint` and `AccumulatorCheckpoint`, with a real kill: 2 gloo CPU
processes save (model, AdamW state, accumulator mid-window and at a window boundary; fp32 and fp16) and SIGKILL
themselves; a fresh 2-process launch loads each checkpoint into a differently seeded sharded model and finishes the
run. Final weights, AdamW state and loss scaler must be bitwise those of the uninterrupted run."""

import json
from pathlib import Path

import pytest
import torch

from hf_gradaccum import AccumulatorCheckpoint, GradientAccumulator
from tests.multiprocess import run_script
from tests.torch_features import needs_fsdp2_torch

pytestmark = needs_fsdp2_torch

WORKER = "tests/workers/fsdp2_checkpoint.py"
RANKS = (0, 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_dcp")
    run_script(WORKER, "save", "2", str(out))
    run_script(WORKER, "resume", "2", str(out))
    return out


def records(out: Path, name: str, rank: int) -> tuple[dict, dict]:
    precision = name.split("_")[0]
    straight = torch.load(out / f"straight_{precision}_rank{rank}.pt", weights_only=False)
    resumed = torch.load(out / f"resumed_{name}_rank{rank}.pt", weights_only=False)
    return straight, resumed


def assert_bitwise(straight: dict, resumed: dict) -> None:
    assert len(straight["weights"]) == len(resumed["weights"]) == 5
    for a, b in zip(straight["weights"], resumed["weights"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight["optim"], resumed["optim"], strict=True):
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight["scaler"] == resumed["scaler"]
    assert straight["applied_steps"] == resumed["applied_steps"] == 3
    assert straight["micro_step"] == resumed["micro_step"] == 9


def test_checkpoint_written_then_every_rank_sigkilled(runs):
    assert json.loads((runs / "save_exit_codes.json").read_text()) == [-9, -9]
    for name in ("fp32_mid", "fp32_boundary", "fp16_mid"):
        # One DCP file per rank (each rank's shards) plus the metadata: no hand-written format.
        assert sorted(p.name for p in (runs / name).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("rank", RANKS)
def test_mid_window_resume_after_kill_is_bitwise(runs, rank):
    straight, resumed = records(runs, "fp32_mid", rank)
    # The checkpoint held window 2 with one of its three micro-batches folded into the sharded buffer.
    assert (resumed["restored_micro_step"], resumed["restored_in_window"]) == (4, 1)
    assert_bitwise(straight, resumed)


@pytest.mark.parametrize("rank", RANKS)
def test_window_boundary_resume_is_bitwise(runs, rank):
    straight, resumed = records(runs, "fp32_boundary", rank)
    assert (resumed["restored_micro_step"], resumed["restored_in_window"]) == (3, 0)
    assert_bitwise(straight, resumed)


def test_uninterrupted_run_matches_hand_computed_large_batch(runs):
    straight = torch.load(runs / "straight_fp32_rank0.pt", weights_only=False)
    # AdamW, 3 windows of 3 uneven micro-batches with different token counts per rank, vs fp64 large batch.
    assert straight["relative_update_error"] <= 1e-5


@pytest.mark.parametrize("rank", RANKS)
def test_fp16_mid_window_resume_restores_loss_scaler(runs, rank):
    straight, resumed = records(runs, "fp16_mid", rank)
    # Saved after an overflow (backoff 4096 -> 2048) and one clean window: not the fresh scaler's 4096 / 0.
    assert resumed["restored_scaler"]["scale"] == 2048.0
    assert resumed["restored_scaler"]["growth_tracker"] == 1
    assert (resumed["restored_micro_step"], resumed["restored_in_window"]) == (7, 1)
    # The restored tracker makes the scale grow back at the end of window 3, as in the uninterrupted run.
    assert straight["scaler"]["scale"] == 4096.0
    assert_bitwise(straight, resumed)


def test_mid_window_load_with_other_accumulation_steps_is_refused(runs):
    for rank in RANKS:
        message = json.loads((runs / f"refused_rank{rank}.json").read_text())["other_steps_error"]
        assert message == (
            "Cannot resume mid-window: the checkpoint was saved with `gradient_accumulation_steps=3` but this run "
            "uses 4."
        )


@pytest.mark.slow
def test_mid_window_load_on_other_world_size_and_partly_sharded_model_are_refused(runs):
    run_script(WORKER, "other_world", "1", str(runs))
    record = json.loads((runs / "other_world1_rank0.json").read_text())
    assert record["fp32_mid"].startswith("Cannot resume mid-window on 1 process(es)")
    assert record["fp32_mid_micro_step"] == 0
    # A window-boundary checkpoint holds no partial window: it loads on any number of processes.
    assert record["fp32_boundary"] is None and record["fp32_boundary_micro_step"] == 3
    assert record["partly_sharded"].startswith("`AccumulatorCheckpoint` needs every trainable parameter sharded")


def test_replicated_accumulator_is_refused():
    accumulator = GradientAccumulator(torch.nn.Linear(3, 2), gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"FSDP2 \(`fully_shard`\) model.*torch.save"):
        AccumulatorCheckpoint(accumulator)
    with pytest.raises(TypeError, match="must be a GradientAccumulator"):
        AccumulatorCheckpoint(torch.nn.Linear(3, 2))
