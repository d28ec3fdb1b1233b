"""`hf-gradaccum test` and `hf-gradaccum env`: the self-test passes on this machine, and each of its checks fails when
the part of the engine it checks is broken (the break is made in a real process through `sitecustomize`, which every
Python process of the run, the spawned ranks included, imports at start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.multiprocess import ROOT
from tests.torch_features import FSDP2_TORCH

BREAKS = {
    # every micro-batch weighted equally, whatever its items
    "weighting": """
        from hf_gradaccum.engine.accumulator import GradientAccumulator
        GradientAccumulator._resolve_num_items = lambda self, num_items, batch: 1.0
    """,
    # an fp16 overflow drops the window (the "skip" policy) instead of redoing the micro-batch
    "recompute": """
        from hf_gradaccum.engine.accumulator import GradientAccumulator
        def skip_policy(self, compute_loss, num_items=None, *, batch=None):
            loss = compute_loss()
            self.backward(loss, self._resolve_num_items(num_items, batch))
            return loss.detach()
        GradientAccumulator.accumulate_micro_batch = skip_policy
    """,
    # out-of-memory errors are not recognised, so nothing is retried
    "oom": """
        import hf_gradaccum.engine.oom_retry as oom_retry
        oom_retry.is_out_of_memory = lambda error: False
    """,
    # DDP: the buffers are not all-reduced at the window's end; FSDP2: the reduce-scatter averages
    "reduction": """
        import hf_gradaccum.engine.accumulator as accumulator
        import hf_gradaccum.engine.sharded.buffer_choice as sharded
        reduce_window = accumulator.reduce_window
        def statistics_only(*args, **kwargs):
            return reduce_window(*args, **{**kwargs, "reduce_buffers": False})
        accumulator.reduce_window = statistics_only
        original = sharded.prepare_fsdp2_for_summing
        def averaging(model):
            modules = original(model)
            for module in modules:
                module.set_gradient_divide_factor(2.0)
            return modules
        sharded.prepare_fsdp2_for_summing = averaging
    """,
}


def run_self_test(tmp_path, *args: str, break_: str | None = None) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    if break_ is not None:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(textwrap.dedent(BREAKS[break_]))
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "hf_gradaccum.cli", "test", *args, "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.exists(), proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    return proc.returncode, {c["name"]: c for c in record["checks"]}, proc.stdout


def test_self_test_passes_on_this_machine_in_every_precision(tmp_path):
    code, checks, stdout = run_self_test(tmp_path)
    assert code == 0, stdout
    expected = {f"parity/{m}/{p}" for m in ("causal-lm", "classifier") for p in ("fp32", "bf16", "fp16")}
    expected |= {"fp16-overflow/one-micro-batch", "oom-retry/memory-cap"}
    assert set(checks) == expected
    assert all(c["status"] == "pass" for c in checks.values()), stdout  # the CPU supports all three and the cap
    assert "8 passed, 0 failed, 0 skipped" in stdout


def test_full_self_test_adds_ddp_and_fsdp2(tmp_path):
    code, checks, stdout = run_self_test(tmp_path, "--precision", "fp32", "--full")
    assert code == 0, stdout
    assert checks["ddp/2-processes"]["status"] == "pass", stdout
    assert checks["fsdp2/2-processes"]["status"] == ("pass" if FSDP2_TORCH else "skip"), stdout


@pytest.mark.parametrize(
    ("break_", "args", "failing"),
    [
        ("weighting", (), [f"parity/{m}/{p}" for m in ("causal-lm", "classifier") for p in ("fp32", "bf16", "fp16")]),
        ("recompute", ("--precision", "fp16"), ["fp16-overflow/one-micro-batch"]),
        ("oom", ("--precision", "fp32"), ["oom-retry/memory-cap"]),
        ("reduction", ("--precision", "fp32", "--full"), ["ddp/2-processes", "fsdp2/2-processes"]),
    ],
)
def test_each_check_fails_when_what_it_checks_is_broken(tmp_path, break_, args, failing):
    if break_ == "reduction" and not FSDP2_TORCH:
        failing = ["ddp/2-processes"]
    code, checks, stdout = run_self_test(tmp_path, *args, break_=break_)
    assert code == 1, stdout
    assert {name for name, c in checks.items() if c["status"] == "fail"} == set(failing), stdout


def test_env_prints_versions_devices_and_ranges(tmp_path):
    out = tmp_path / "env.json"
    proc = subprocess.run([sys.executable, "-m", "hf_gradaccum.cli", "env", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    env = json.loads(out.read_text())
    for package in ("torch", "transformers", "accelerate"):
        assert env["packages"][package]["version"] in proc.stdout
        status = env["packages"][package]["status"]
        assert status == "tested range" or status.startswith("newer than tested"), status
    assert "| cpu |" in proc.stdout and "fp32" in env["devices"][0]["precisions"]
    assert env["backends"]["gloo"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "fp8"], "must be a comma-separated subset of fp32,bf16,fp16"),
        (["--device", "nonsense"], "--device nonsense: not a device"),
        (["--json", "/nonexistent/dir/out.json"], "does not exist"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(args, message):
    proc = subprocess.run([sys.executable, "-m", "hf_gradaccum.cli", "test", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr
