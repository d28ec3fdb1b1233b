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
