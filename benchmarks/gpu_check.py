"""The GPU acceptance run: one command that checks and measures everything this project claims on one NVIDIA GPU,
and writes `gpu_report.json` + `gpu_report.md` (and the plots) into a folder.

Sections, each a subprocess with its own time limit (one that fails or times out is reported, the rest still run):

| section | what | command it runs |
|---|---|---|
| `env` | versions, devices, backends | `python -m hf_gradaccum env` |
| `self_test` | exactness on this device in every precision it has, the memory cap, DDP and FSDP2 on 2 processes | `python -m hf_gradaccum test --device cuda --full` |
| `cuda_tests` | the tests that skip without a GPU | `pytest tests/test_cuda.py` |
| `memory_limit` | under a memory cap the large batch hits a real CUDA OOM and the accumulated one fits, exactly | `benchmarks/memory_limit_repro.py` |
| `throughput` | samples/s and peak memory vs the stock Trainer and a bare `accelerate.accumulate` loop | `benchmarks/bench_throughput.py` |
| `offload` | the fp32 buffer in host memory: time, GPU gradient bytes, exactness, largest model under a cap | `benchmarks/bench_offload.py` |

It needs only what a GPU image has (torch, transformers, accelerate, pytest; matplotlib for the plots). `datasets` is
needed by `cuda_tests` only (its parity cases are real `datasets.Dataset`s); without it that section is reported as
skipped. The package itself may come from `pip install .` or from the source tree (this script puts the repository
root on `PYTHONPATH` for its subprocesses).

Command (one GPU; about 7 minutes on an H100):

    make gpu-check GPU_REPORT_DIR=gpu_report        # or: python benchmarks/gpu_check.py --out gpu_report

`--device cpu` runs every section on tiny shapes (tests/test_gpu_check.py), so the script cannot rot without a GPU;
`--sections` runs a subset.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "self_test", "cuda_tests", "memory_limit", "throughput", "offload")
# Seconds per section on a GPU; on the CPU (tiny shapes) the same limits are generous.
THROUGHPUT_SUBSET = ["--models", "bert-base,gpt2-small", "--precisions", "bf16", "--ga", "8", "--steps", "6"]
TIME_LIMITS = {"env": 60, "self_test": 150, "cuda_tests": 150, "memory_limit": 120, "throughput": 200, "offload": 150}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for gpu_report.json, gpu_report.md, plots.")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: tiny shapes, a smoke run.")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"Comma-separated subset of {', '.join(SECTIONS)}."
    )
    parser.add_argument("--time_scale", type=float, default=1.0, help="Multiply every section's time limit.")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}.")
    return args


def section_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    out, py, cpu = args.out, sys.executable, args.device == "cpu"
    tiny = ["--device", "cpu", "--tiny"] if cpu else ["--device", "cuda"]
    return {
        "env": [py, "-m", "hf_gradaccum", "env"],
        "self_test": [py, "-m", "hf_gradaccum", "test", "--device", args.device, "--json", str(out / "self_test.json")]
        + ([] if cpu else ["--full"]),
        "cuda_tests": [py, "-m", "pytest", "tests/test_cuda.py", "-q", "-rA", "-p", "no:cacheprovider"],
        "memory_limit": [py, "benchmarks/memory_limit_repro.py", *tiny, "--out", str(out / "memory_limit.json")],
        # The full grid (2 models x 3 precisions x GA 1/8 x 4 runners) takes about 14 minutes on an H100, most of it
        # process start-up; the check runs the accumulating points of the precisions that hold the memory goal.
        "throughput": [py, "benchmarks/bench_throughput.py", *tiny, "--out", str(out / "throughput.json")]
        + (["--models", "bert-base", "--precisions", "fp32", "--ga", "2"] if cpu else THROUGHPUT_SUBSET),
        "offload": [py, "benchmarks/bench_offload.py", *tiny, "--out", str(out / "offload.json")],
    }


def run_section(name: str, command: list[str], limit: float, log_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["PYTHONUNBUFFERED"] = "1"
    log = log_dir / f"{name}.log"
    print(f"== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as stream:
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT, timeout=limit)
            status = "passed" if done.returncode == 0 else "failed"
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            status, code = "timeout", None
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    if name == "cuda_tests" and code == 5:  # pytest: no tests collected
        status = "failed"
    print(f"   {status} in {seconds:.0f} s", flush=True)
    return {"section": name, "status": status, "exit_code": code, "seconds": round(seconds, 1),
            "command": " ".join(command), "log_tail": text[-3000:]}  # fmt: skip


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], total: float) -> None:
    out = args.out
    report: dict[str, Any] = {
        "device": args.device,
        "command": " ".join([Path(sys.executable).name, "benchmarks/gpu_check.py", *sys.argv[1:]]),
        "seconds": round(total, 1),
        "sections": results,
        "all_passed": all(r["status"] in ("passed", "skipped") for r in results),
    }
    for name in ("self_test", "memory_limit", "throughput", "offload"):
        report[name] = read_json(out / f"{name}.json")
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))

    lines = [
        "# GPU acceptance run",
        "",
        f"Command: `{report['command']}`; {total:.0f} s in all.",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
        *[f"| {r['section']} | {r['status']} | {r['seconds']} |" for r in results],
    ]
    for r in results:
        lines += ["", f"## {r['section']}", "", f"`{r['command']}`", ""]
        md = out / f"{r['section']}.md"
        if md.exists():
            lines.append(md.read_text().strip())
        else:
            lines += ["```", _relevant_tail(r), "```"]
    (out / "gpu_report.md").write_text("\n".join(lines) + "\n")


def _relevant_tail(result: dict[str, Any]) -> str:
    """The end of a section's log: the part that says what passed or failed."""
    tail = result["log_tail"].strip().splitlines()
    return "\n".join(tail[-40:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    commands = section_commands(args)
    scale = args.time_scale * (2.0 if args.device == "cpu" else 1.0)
    results = []
    start = time.perf_counter()
    for name in args.sections.split(","):
        if name == "cuda_tests" and importlib.util.find_spec("datasets") is None:
            results.append({"section": name, "status": "skipped", "exit_code": None, "seconds": 0.0,
                            "command": " ".join(commands[name]),
                            "log_tail": "skipped: `datasets` is not installed (the CUDA tests' data are datasets)."})  # fmt: skip
            continue
        results.append(run_section(name, commands[name], TIME_LIMITS[name] * scale, log_dir))
        write_report(args, results, time.perf_counter() - start)  # a report even if the run is cut off later
    total = time.perf_counter() - start
    write_report(args, results, total)
    print((args.out / "gpu_report.md").read_text())
    return 0 if all(r["status"] in ("passed", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
