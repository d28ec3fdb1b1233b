"""`make gpu-check` (benchmarks/gpu_check.py) end to end on the CPU, tiny shapes, so the one-command GPU run cannot
rot between the sessions that have a GPU. The memory-limit and throughput sections have their own CPU tests
(tests/test_memory_limit_repro.py, tests/test_bench_throughput.py); the self-test section is `hf-gradaccum test`
(tests/test_self_test.py)."""

import json
import subprocess
import sys

from tests.multiprocess import ROOT


def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "report"
    sections = "env,cuda_tests,offload"
    command = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(out), "--sections", sections]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_report.json").read_text())
    assert [s["section"] for s in report["sections"]] == sections.split(",")
    assert report["all_passed"] and all(s["status"] == "passed" for s in report["sections"])
    # The offload benchmark's exactness figure: the host buffer gives the device buffer's gradient.
    offload = report["offload"]
    assert offload["comparison"]["offload_equals_device_buffer"] is True
    assert {r["arm"] for r in offload["results"]} == {"stock", "device", "offload"}
    assert all(r["status"] == "ok" for r in offload["results"])
    markdown = (out / "gpu_report.md").read_text()
    assert "| offload | passed |" in markdown and "offload_vs_device_relative_gradient_error" in markdown
