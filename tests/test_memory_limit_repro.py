"""`benchmarks/memory_limit_repro.py` on CPU (`--device cpu --tiny`): no memory cap exists there, but every arm still
runs in its own process and the accumulated update must match the large-batch update (relative error <= 1e-5), so
the GPU reproduction cannot rot on machines without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "memory_limit_repro.py"


def test_memory_limit_repro_cpu_tiny(tmp_path):
    out = tmp_path / "memory_limit_repro.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.is_file(), output
    assert out.with_suffix(".md").is_file(), output
    report = json.loads(out.read_text())
    assert set(report["models"]) == {"bert", "resnet"}
    for name, result in report["models"].items():
        arms = {record["arm"]: record for record in result["arms"]}
        assert set(arms) == {"large_uncapped", "large_capped", "accumulated_capped"}, name
        assert arms["large_uncapped"]["status"] == "ok", (name, arms["large_uncapped"])
        for arm in ("large_capped", "accumulated_capped"):
            assert arms[arm]["status"] == "no_cap_on_cpu", (name, arms[arm])
        accumulated = arms["accumulated_capped"]
        micro, steps = result["micro_batch"], result["gradient_accumulation_steps"]
        assert steps > 1 and micro * steps == result["large_batch"], name
        assert accumulated["micro_batches_seen"] == [micro] * steps, (name, accumulated["micro_batches_seen"])
        errors = [r["relative_update_error"] for arm, r in arms.items() if arm != "large_uncapped"]
        assert all(e is not None and e <= RTOL for e in errors), (name, errors)
        assert result["checks"]["parity"]["passed"] is True, (name, result["checks"])
        assert result["passed"] is True, (name, result["checks"])
    assert report["passed"] is True
    assert proc.returncode == 0, output
