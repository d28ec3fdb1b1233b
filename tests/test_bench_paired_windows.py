"""`benchmarks/bench_paired_windows.py` end to end on CPU at tiny shapes: both trainers in one process, windows
alternating, every window timed and the ratios summarised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "bench_paired_windows.py"


@pytest.mark.parametrize("first", ["stock", pytest.param("gradaccum", marks=pytest.mark.slow)])
def test_bench_paired_windows_tiny_cpu(tmp_path: Path, first: str) -> None:
    out = tmp_path / "paired.json"
    models = "minilm,gpt2-small" if first == "stock" else "resnet18"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--models", models, "--windows", "3", "--first", first]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    payload = json.loads(out.read_text())
    assert [row["model"] for row in payload["rows"]] == models.split(",")
    assert payload["meta"]["first"] == first
    for raw, row in zip(payload["raw"], payload["rows"], strict=True):
        # 3 timed windows + 1 warm-up per trainer, each a (thread CPU, wall) pair.
        assert {name: len(times) for name, times in raw["windows"].items()} == {"stock": 4, "gradaccum": 4}
        assert all(
            cpu > 0 and wall >= cpu * 0.5 and faults >= 0
            for times in raw["windows"].values()
            for cpu, wall, faults in times
        )
        # Each of ours' windows but the last sits between two stock windows.
        assert row["windows"] == 2
        q = row["speed_ratio"]
        assert 0 < q["min"] <= q["q1"] <= q["median"] <= q["q3"] <= q["max"]
        assert 0 <= row["ours_faster"] <= row["windows"]
    assert f"| {models.split(',')[0]} (length 32) | 4 x 8 |" in out.with_suffix(".md").read_text()


def test_bench_paired_windows_loops_tiny_cpu(tmp_path: Path) -> None:
    """`--pair loops`: the GradientAccumulator loop against Accelerate's `accumulate` loop. Each loop steps once per
    window of 8 micro-batches (Accelerate's process-wide accumulation steps survive the other loop's Accelerator)."""
    out = tmp_path / "loops.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--pair", "loops", "--models", "minilm", "--windows", "3"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    payload = json.loads(out.read_text())
    assert payload["meta"]["pair"] == "loops"
    (raw,) = payload["raw"]
    assert {name: len(times) for name, times in raw["windows"].items()} == {"stock": 4, "gradaccum": 4}
    report = out.with_suffix(".md").read_text()
    assert report.startswith("# The GradientAccumulator loop against Accelerate's `accumulate` loop")
    assert "speed ours / accelerate" in report

    refused = subprocess.run(
        [*cmd[:-2], "--first", "gradaccum", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert refused.returncode == 2 and "--pair loops needs --first stock" in refused.stderr


def test_bench_paired_windows_refuses_an_unknown_model(tmp_path: Path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--models", "minilm,llama", "--out", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert "--models: unknown ['llama']" in proc.stderr


def test_shapes_on_a_gpu_are_bench_throughputs(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import bench_paired_windows

    opts = bench_paired_windows.argparse.Namespace(
        tiny=False,
        image_size=None,
        seq_len=None,
        micro_batch=None,
        device="cuda",
        windows=20,
        warmup=1,
        seed=0,
        ga=8,
        precision="bf16",
    )
    shapes = {
        model: {
            name: (s["micro_batch"], s["seq_len"], s["device"], s["precision"], s["steps"])
            for name, s in specs.items()
        }
        for model in ("bert-base", "gpt2-small", "resnet18", "minilm")
        for specs in [bench_paired_windows.shape_specs(model, opts)]
    }
    assert shapes["bert-base"]["stock"] == shapes["bert-base"]["gradaccum"] == (16, 128, "cuda", "bf16", 21)
    assert shapes["gpt2-small"]["gradaccum"] == (8, 256, "cuda", "bf16", 21)
    assert shapes["resnet18"]["stock"][:2] == (16, 224)
    assert shapes["minilm"]["stock"][:2] == (8, 128)
    # On a CPU, the shapes of docs/measurements.md.
    cpu = bench_paired_windows.shape_specs(
        "gpt2-small", bench_paired_windows.argparse.Namespace(**{**vars(opts), "device": "cpu"})
    )
    assert (cpu["stock"]["micro_batch"], cpu["stock"]["seq_len"]) == (2, 64)
