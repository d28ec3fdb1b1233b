"""A crash must not cost the run: SIGKILL at several points (mid-window, and while a checkpoint is being written),
then resume; the final weights are bitwise identical to an uninterrupted run, and no `checkpoint-N` directory is
ever half-written. Plus a soak run with injected NaN losses and fp16 overflows."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_gradaccum import DynamicLossScaler, GradientAccumulator

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "accumulator_state.pt"}


def _run(output_dir, *extra):
    cmd = [sys.executable, "-m", "tests.workers.kill_worker", str(output_dir), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _assert_complete_checkpoints(output_dir):
    for entry in os.listdir(output_dir):
        if entry.startswith("checkpoint-"):
            files = set(os.listdir(os.path.join(output_dir, entry)))
            assert CHECKPOINT_FILES <= files, f"{entry} is incomplete: {sorted(files)}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "final.pt")


@pytest.mark.parametrize(
    "kill_at",
    [
        "window:2",
        # ~13 s each: with the slow tests, so that `make test` stays under 10 minutes.
        pytest.param("save:3", marks=pytest.mark.slow),
        pytest.param("save:1", marks=pytest.mark.slow),
        pytest.param("window:6", marks=pytest.mark.slow),
    ],
)
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, uninterrupted, kill_at):
    killed = _run(tmp_path, "--kill_at", kill_at)
    assert killed.returncode == -signal.SIGKILL
    _assert_complete_checkpoints(tmp_path)
    step = int(kill_at.split(":")[1])
    published = sorted(int(e.split("-")[1]) for e in os.listdir(tmp_path) if e.startswith("checkpoint-"))
    # Killed while writing checkpoint-N: it must not appear; the previous one is the resume point.
    assert max(published, default=0) == (step - 1 if kill_at.startswith("save") else step)

    resumed = _run(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_complete_checkpoints(tmp_path)
    final = torch.load(tmp_path / "final.pt")
    assert final["scaler"] == uninterrupted["scaler"]
    for a, b in zip(final["weights"], uninterrupted["weights"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # ~70 s on 2 cores
def test_soak_2000_steps_with_injected_nans_and_overflows():
    """2,000 optimizer steps of a tiny fp16 (CPU autocast) model; ~3% of micro-batches get a NaN loss and ~3% a
    gradient that overflows at the current scale. No crash, no non-finite weight, every skip counted."""
    rng = random.Random(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=20)
    acc = GradientAccumulator(model, 2, loss_scaler=scaler)
    nan_windows = 0
    for _ in range(2000):
        window_has_nan = False
        for _ in range(2):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            event = rng.random()
            nan, overflow = event < 0.03, 0.03 <= event < 0.06
            window_has_nan |= nan

            def compute_loss(x=x, y=y, nan=nan, overflow=overflow):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = torch.nn.functional.mse_loss(out.float(), y)
                # An overflow: a finite loss whose scaled gradient leaves fp16's range at scales >= 2**4.
                return loss * float("nan") if nan else (loss * 4096.0 if overflow else loss)

            acc.accumulate_micro_batch(compute_loss, num_items=4)
        nan_windows += window_has_nan
        acc.step(optimizer, max_grad_norm=1.0)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    print(f"soak: {acc.metrics()}, scaler overflows {scaler.num_overflows}, NaN windows {nan_windows}")
    assert acc.applied_steps + sum(acc.skipped_steps.values()) == 2000
    assert acc.skipped_steps["non_finite_loss"] == nan_windows > 0
    assert acc.recomputed_micro_batches > 0 and scaler.num_overflows >= acc.recomputed_micro_batches
