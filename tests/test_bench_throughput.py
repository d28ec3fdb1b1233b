"""`benchmarks/bench_throughput.py` end to end on CPU: tiny BERT, fp32, GA 2, all four runners, one subprocess each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "bench_throughput.py"
RUNNERS = ("stock", "gradaccum", "accelerate_loop", "gradaccum_loop")


def test_bench_throughput_tiny_cpu_grid(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--tiny",
        "--models",
        "bert-base",
        "--precisions",
        "fp32",
        "--ga",
        "2",
        "--runners",
        ",".join(RUNNERS),
        "--timeout",
        "120",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [r["spec"]["runner"] for r in results] == list(RUNNERS)
    for r in results:
        assert r["status"] == "ok", f"{r['spec']['runner']}: {r.get('status')}: {r.get('error') or r.get('reason')}"
        assert r["samples_per_s"] > 0
        assert r["peak_mib"] > 0
        assert r["optimizer_steps"] == r["spec"]["steps"] == 2
        assert r["timed_steps"] == 1
        assert len(r["page_faults_per_step"]) == 1 and r["page_faults_per_step"][0] >= 0
    for r in results:
        if r["spec"]["runner"] in ("gradaccum", "gradaccum_loop"):
            assert r["accumulator"]["applied_steps"] == 2, r["accumulator"]

    assert len(payload["rows"]) == 1
    row = payload["rows"][0]
    assert (row["model"], row["precision"], row["ga"], row["micro_batch"]) == ("bert-base", "fp32", 2, 4)
    assert row["speed_gradaccum_vs_stock"] > 0 and row["speed_loop_vs_accelerate"] > 0
    assert set(row["goals"]) == {"speed_vs_stock", "speed_vs_loop", "memory_vs_stock"}
    assert all(isinstance(v, bool) for v in row["goals"].values())
    assert payload["meta"]["counts"] == {"ok": 4, "skipped": 0, "failed": 0, "timeout": 0}

    md = out.with_suffix(".md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| bert-base |")]
    assert len(table_rows) == 1 and table_rows[0].startswith("| bert-base | fp32 | 2 | 4 |")
    assert "not run" not in table_rows[0] and "failed" not in table_rows[0]
    assert table_rows[0] in proc.stdout  # the table is printed too


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_give_the_median_of_per_round_ratios_and_their_range() -> None:
    """Per-round pairing: each round's ours/stock ratio is computed within the round, and the row reports their
    median and range (not the ratio of medians, which pairs runs of different rounds)."""
    bench = _load_script()

    def result(runner: str, round_index: int, wall: float, cpu: float) -> dict:
        spec = {
            "model": "minilm",
            "precision": "fp32",
            "ga": 8,
            "micro_batch": 4,
            "runner": runner,
            "round": round_index,
        }
        return {"spec": spec, "status": "ok", "samples_per_s": wall, "samples_per_cpu_s": cpu, "peak_mib": 100.0}

    results = [
        result("stock", 0, 10.0, 5.0),
        result("gradaccum", 0, 9.0, 5.5),  # round 0: 0.9 (wall), 1.1 (cpu)
        result("gradaccum", 1, 20.0, 4.0),
        result("stock", 1, 20.0, 5.0),  # round 1: 1.0, 0.8
        result("stock", 2, 10.0, 5.0),
        result("gradaccum", 2, 12.0, 5.0),  # round 2: 1.2, 1.0
    ]
    (wall,) = bench.summarize(results, "wall")
    assert wall["rounds"] == 3
    assert wall["speed_gradaccum_vs_stock"] == 1.0
    assert wall["speed_gradaccum_vs_stock_range"] == [0.9, 1.2]
    assert wall["speed_loop_vs_accelerate"] is None
    (cpu,) = bench.summarize(results, "cpu")
    assert cpu["speed_gradaccum_vs_stock"] == 1.0
    assert cpu["speed_gradaccum_vs_stock_range"] == [0.8, 1.1]
    assert cpu["stock_samples_per_s"] == 5.0


def test_resnet18_worker_trains_on_cpu() -> None:
    """The image shape runs end to end in a worker (tiny ResNet, GradAccumTrainer, 2 optimizer steps)."""
    bench = _load_script()
    import argparse

    opts = argparse.Namespace(
        tiny=True,
        device="cpu",
        steps=None,
        micro_batch=None,
        seq_len=None,
        image_size=None,
        cpu_threads=1,
        seed=0,
        rounds=1,
        bert_micro_batch=16,
        gpt2_micro_batch=8,
    )
    spec = bench.make_spec(opts, "resnet18", "fp32", 2, "gradaccum")
    result = bench.launch(spec, timeout_s=300)
    assert result["status"] == "ok", result.get("error") or result.get("stderr_tail")
    assert result["optimizer_steps"] == 2 and result["accumulator"]["applied_steps"] == 2
    assert result["samples_per_s"] > 0 and result["samples_per_cpu_s"] > 0


def test_allocator_settings_reach_the_workers_environment() -> None:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import bench_throughput

    spec = {"device": "cpu", "cpu_threads": 1, "allocator": "glibc-retain"}
    env = bench_throughput.worker_env(spec)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 * 1024 * 1024)
    assert env["MALLOC_TRIM_THRESHOLD_"] == str(16 * 1024**3)
    assert "MALLOC_MMAP_THRESHOLD_" not in bench_throughput.worker_env({**spec, "allocator": "default"})
