"""`GradAccumTrainer` against the stock `transformers.Trainer`, window by window in one process.

Separate processes (`bench_throughput.py --rounds`) compare runs that differ in more than the trainer: where the
allocator put the model, what else the machine did that minute. On this project's 2-core CPU that moves a ratio by
+-3% from pair to pair, more than what is measured. Here both trainers train the same model (two copies from one
seed, the same synthetic rows, the same arguments) in one process, each in its own thread, and hand a baton to each
other at every optimizer step: stock's window 1, ours' window 1, stock's window 2, ... Only the thread holding the
baton runs, so the two never share the CPU. Torch runs one intra-op thread, so a window's work is its thread's CPU time
(`time.thread_time`), which does not count the other trainer's window or time spent waiting. A window is timed from
the moment its thread gets the baton to its `on_step_end`: prefetching and counting the window, the micro-batches'
forward and backward, clipping, the optimizer step and the callbacks. Each window's minor page faults (memory the
kernel maps and zeroes on first touch, `RUSAGE_THREAD`) are recorded beside its time.

Reported per shape: the median window time of each trainer (after `--warmup` windows), and the speed ratio stock /
ours of each window of ours against the mean of the stock windows just before and just after it (this cancels a
drift of the machine's speed), as median, quartiles and range, and how many of ours were faster than that mean.
Peak memory is not measured here (one process holds both); `bench_throughput.py` measures it, each runner in its own
process.

Command (from the repository root; about 12 minutes for the three shapes at 20 windows on an idle 2-core CPU):

    python benchmarks/bench_paired_windows.py --models minilm,gpt2-small,resnet18 --windows 20 \\
        --out benchmarks/results/paired_windows_cpu.json

Shapes are those of `bench_throughput.py` (`--micro_batch`, `--seq_len`, `--image_size` override them; defaults here
are the CPU shapes of docs/measurements.md: MiniLM micro-batch 4 x GA 8 at sequence 128, GPT-2-small micro-batch
2 x GA 8 at sequence 64 with uneven padding, ResNet-18 micro-batch 4 x GA 8 at 64 x 64 pixels). fp32 (`--precision`
for bf16 / fp16), AdamW, `max_grad_norm=1.0`, constant learning rate, as there.

On a GPU (`--device cuda`) each window is timed in wall time, synchronized at its end, so that a host-bound step (a
GPU waiting for Python) is compared within one process and one minute of the machine:

    python benchmarks/bench_paired_windows.py --device cuda --precision bf16 --models bert-base,gpt2-small \\
        --windows 20 --out $OUT/paired_windows_cuda.json

(there the shapes are `bench_throughput.py`'s: BERT-base micro-batch 16 at sequence 128, GPT-2-small micro-batch 8 at
sequence 256).

`--pair loops` compares the plain loops instead, the same way: `GradientAccumulator` (`accumulator.backward`,
`accumulator.step(optimizer, max_grad_norm=1.0)`) against Accelerate's `accelerator.accumulate` with
`clip_grad_norm_`, both `bench_throughput.py`'s loops (`run_gradaccum_loop`, `run_accelerate_loop`), AdamW. Accelerate's
gradient state is process-wide: the Accelerate loop's accumulation steps are set again each time its thread gets the
baton (the other loop's `Accelerator` is made with 1), and the Accelerate loop runs the first window (`--first stock`:
its last window must not see the other loop's finished data loader).
"""

from __future__ import annotations

import os

# One intra-op thread in every thread of the process, set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import (  # noqa: E402
    MODELS,
    allocator_env,
    build_data,
    build_model,
    make_spec,
    run_accelerate_loop,
    run_gradaccum_loop,
    trainer_arguments,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TRAINERS = ("stock", "gradaccum")
# The two roles of a pair (the baseline, ours), by `--pair`: bench_throughput.py's runner for each.
PAIRS = {
    "trainers": {"stock": "stock", "gradaccum": "gradaccum"},
    "loops": {"stock": "accelerate_loop", "gradaccum": "gradaccum_loop"},
}
LABELS = {
    "trainers": ("stock", "the stock Trainer", "GradAccumTrainer"),
    "loops": ("accelerate", "Accelerate's `accumulate` loop", "the GradientAccumulator loop"),
}
# bench_throughput.py's default micro-batches for the GPU shapes.
GPU_MICRO_BATCH = {"bert-base": 16, "gpt2-small": 8}
DEFAULT_SHAPES = {"minilm": (4, 128), "gpt2-small": (2, 64), "resnet18": (4, 64), "bert-base": (4, 128)}


class Baton:
    """Lets one of two threads run at a time; the other waits (without using the CPU) until it is handed over."""

    def __init__(self, first: str, second: str) -> None:
        self._names = (first, second)
        self._turn = first
        self._finished: set[str] = set()
        self._condition = threading.Condition()

    def _other(self, name: str) -> str:
        return self._names[1] if name == self._names[0] else self._names[0]

    def wait_for_turn(self, name: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._turn == name or self._other(name) in self._finished)

    def hand_over(self, name: str) -> None:
        with self._condition:
            self._turn = self._other(name)
            self._condition.notify_all()

    def finish(self, name: str) -> None:
        with self._condition:
            self._finished.add(name)
            self._turn = self._other(name)
            self._condition.notify_all()


def _tcmalloc_loaded() -> bool:
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def use_tcmalloc(argv: list[str]) -> None:
    """Run this benchmark again with tcmalloc preloaded (`--allocator tcmalloc`), unless it already is.

    glibc's malloc hands memory back to the kernel as a training step frees it, and the next step's allocations are
    then mapped and zeroed page by page again. How much of that happens depends on the allocation history (the heap's
    top, glibc's adaptive thresholds, one arena per thread), so a window costs one of two times at random (ResNet-18
    here: about 0.38 s without those page faults, 0.56 s with 110,000 per window). tcmalloc keeps freed memory for
    reuse, so the comparison measures the trainers, not the allocator's state."""
    if _tcmalloc_loaded():
        return
    env = {**os.environ, **allocator_env("tcmalloc", dict(os.environ))}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def _thread_page_faults() -> int:
    """Minor page faults of the calling thread so far (memory the kernel had to map, and zero, on first touch)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _window_clock(name: str, baton: Baton, times: list[tuple[float, float, int]], cuda: bool) -> Any:
    import torch
    from transformers import TrainerCallback

    class WindowClock(TrainerCallback):
        """Times each window (thread CPU time and wall time) and hands the baton over at its end."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.cpu, self.wall, self.faults = time.thread_time(), time.perf_counter(), _thread_page_faults()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda:  # the window's kernels, not only their launches; the other trainer starts on an idle GPU
                torch.cuda.synchronize()
            times.append(
                (time.thread_time() - self.cpu, time.perf_counter() - self.wall, _thread_page_faults() - self.faults)
            )
            baton.hand_over(name)
            baton.wait_for_turn(name)
            self.cpu, self.wall, self.faults = time.thread_time(), time.perf_counter(), _thread_page_faults()

    return WindowClock()


def shape_specs(model_name: str, opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """`bench_throughput.py`'s spec of each trainer for `model_name`: the CPU shapes of docs/measurements.md, or on
    a GPU `bench_throughput.py`'s own (BERT-base micro-batch 16, GPT-2-small 8); `--micro_batch`, `--seq_len` and
    `--image_size` override either."""
    micro, length = DEFAULT_SHAPES[model_name] if opts.device == "cpu" and not opts.tiny else (None, None)
    spec_opts = argparse.Namespace(
        tiny=opts.tiny,
        bert_micro_batch=GPU_MICRO_BATCH["bert-base"],
        gpt2_micro_batch=GPU_MICRO_BATCH["gpt2-small"],
        image_size=opts.image_size or (length if model_name == "resnet18" else None),
        seq_len=opts.seq_len or (length if model_name != "resnet18" else None),
        micro_batch=opts.micro_batch or micro,
        device=opts.device,
        steps=opts.windows + opts.warmup,
        seed=opts.seed,
        cpu_threads=1,
        rounds=1,
    )
    runners = PAIRS[getattr(opts, "pair", "trainers")]
    return {name: make_spec(spec_opts, model_name, opts.precision, opts.ga, runners[name]) for name in TRAINERS}


class _LoopWindowClock:
    """`bench_throughput.py`'s meter for a plain loop: times each window as `_window_clock` does and hands the baton
    over at its end (`step_end`); `on_turn` runs each time the loop gets the baton back."""

    def __init__(self, name: str, baton: Baton, times: list, cuda: bool, on_turn: Any = None) -> None:
        self.name, self.baton, self.times, self.cuda, self.on_turn = name, baton, times, cuda, on_turn
        self.step_ends: list[float] = []

    def _start(self) -> None:
        self.cpu, self.wall, self.faults = time.thread_time(), time.perf_counter(), _thread_page_faults()

    def begin(self) -> None:
        self._start()

    def step_end(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(
            (time.thread_time() - self.cpu, time.perf_counter() - self.wall, _thread_page_faults() - self.faults)
        )
        self.step_ends.append(time.perf_counter())
        self.baton.hand_over(self.name)
        self.baton.wait_for_turn(self.name)
        if self.on_turn is not None:
            self.on_turn()
        self._start()


def _accelerate_steps_again(ga: int) -> Any:
    """Sets Accelerate's process-wide accumulation steps back to `ga` (another `Accelerator` in the process resets
    them when it is made)."""

    def again() -> None:
        from accelerate.state import GradientState
        from accelerate.utils import GradientAccumulationPlugin

        GradientState(GradientAccumulationPlugin(num_steps=ga))

    return again


def run_shape(model_name: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Both trainers on one shape, windows alternating; returns each trainer's window times."""
    import torch
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    from hf_gradaccum import GradAccumTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    specs = shape_specs(model_name, opts)
    data = build_data(specs["stock"])
    baton = Baton(*(TRAINERS if opts.first == "stock" else TRAINERS[::-1]))
    times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in TRAINERS}
    errors: dict[str, BaseException] = {}
    # What ours' loss measurement found and cost: the first window's measurement, the later windows' re-weighing.
    checks: dict[str, dict[str, Any]] = {}

    def train(name: str) -> None:
        torch.set_num_threads(1)
        baton.wait_for_turn(name)
        try:
            if opts.pair == "loops":
                loop = run_gradaccum_loop if name == "gradaccum" else run_accelerate_loop
                on_turn = None if name == "gradaccum" else _accelerate_steps_again(specs[name]["ga"])
                clock = _LoopWindowClock(name, baton, times[name], opts.device == "cuda", on_turn)
                loop(specs[name], build_model(specs[name]), data, clock)
                return
            trainer_cls = GradAccumTrainer if name == "gradaccum" else Trainer
            trainer = trainer_cls(
                model=build_model(specs[name]),
                args=trainer_arguments(specs[name]),
                train_dataset=data,
                callbacks=[_window_clock(name, baton, times[name], opts.device == "cuda")],
            )
            trainer.train()
            if name == "gradaccum":
                rule = trainer._loss_rule
                finding = rule.finding
                checks[name] = {
                    "rule": None if finding is None else finding.rule,
                    "decided_by": None if finding is None else finding.decided_by,
                    "first_window_s": None if finding is None else finding.seconds,
                    "windows_rechecked": rule.recheck.windows_checked if rule.recheck else 0,
                    "recheck_s": rule.recheck_seconds,
                }
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors[name] = error
        finally:
            baton.finish(name)

    threads = [threading.Thread(target=train, args=(name,), name=name) for name in TRAINERS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        name, error = next(iter(errors.items()))
        raise RuntimeError(f"{name} failed on {model_name}") from error
    spec = specs["stock"]
    return {
        "model": model_name,
        "micro_batch": spec["micro_batch"],
        "ga": spec["ga"],
        "length": spec["seq_len"],
        "precision": opts.precision,
        "first": opts.first,
        "pair": opts.pair,
        "metric": "wall" if opts.device == "cuda" else "cpu",
        "windows": {name: times[name] for name in TRAINERS},
        "loss_check": checks.get("gradaccum"),
    }


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
    return {"min": ordered[0], "q1": q[0], "median": q[1], "q3": q[2], "max": ordered[-1]}


def _check_cost(result: dict[str, Any]) -> dict[str, Any] | None:
    """Ours' loss measurement against ours' training time: the first window's, and the later windows' re-weighing as a
    fraction of the later windows' time (all windows, warm-up included: the check runs in every one)."""
    check = result.get("loss_check")
    if not check:
        return None
    column = 1 if result.get("metric") == "wall" else 0
    later = sum(times[column] for times in result["windows"]["gradaccum"][1:])
    return {**check, "recheck_fraction": check["recheck_s"] / later if later > 0 else None}


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median window time per trainer (thread CPU time on a CPU, wall time on a GPU); per window of ours, stock's mean
    of its neighbours / ours."""
    column = 1 if result.get("metric") == "wall" else 0
    stock = [times[column] for times in result["windows"]["stock"]][warmup:]
    ours = [times[column] for times in result["windows"]["gradaccum"]][warmup:]
    # Stock first: stock's window k ran just before ours' window k, and stock's window k+1 just after it. Ours first:
    # stock's windows k-1 and k.
    shift = 0 if result.get("first", "stock") == "stock" else 1
    ratios = [
        (stock[k - shift] + stock[k + 1 - shift]) / 2 / ours[k]
        for k in range(shift, min(len(ours), len(stock) - 1 + shift))
    ]
    if not ratios:
        raise ValueError("too few windows: raise --windows")
    return {
        "model": result["model"],
        "micro_batch": result["micro_batch"],
        "ga": result["ga"],
        "length": result["length"],
        "precision": result.get("precision", "fp32"),
        "windows": len(ratios),
        "stock_median_s": statistics.median(stock),
        "ours_median_s": statistics.median(ours),
        "stock_page_faults": statistics.median(w[2] for w in result["windows"]["stock"][warmup:]),
        "loss_check": _check_cost(result),
        "ours_page_faults": statistics.median(w[2] for w in result["windows"]["gradaccum"][warmup:]),
        "speed_ratio": _quantiles(ratios),
        "ours_faster": sum(r > 1.0 for r in ratios),
    }


def _sentence_start(text: str) -> str:
    return text[:1].upper() + text[1:]


def markdown(rows: list[dict[str, Any]], command: str, meta: dict[str, Any]) -> str:
    short, baseline, ours = LABELS[meta.get("pair", "trainers")]
    lines = [
        f"# {_sentence_start(ours)} against {baseline}, alternating windows in one process",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}; one intra-op thread; "
        f"{meta['precision']}; allocator {meta['allocator']}; "
        + (
            "wall time per window, CUDA synchronized at its end"
            if meta["device_kind"] == "cuda"
            else "thread CPU time per window"
        )
        + f"; {meta['warmup']} warm-up window(s) of each trainer left out; {meta['seconds']:.0f} s.",
        "",
        f"Speed ratio: for each window of ours, the mean of the {short} windows just before and just after it divided "
        "by ours (above 1: ours faster).",
        "",
        f"{_sentence_start(baseline if meta['first'] == 'stock' else ours)} ran the first window.",
        "",
        f"| shape | micro x GA | windows | {short} s/window (median) | ours s/window (median) | speed ours / {short}: "
        f"median (quartiles; range) | ours faster | page faults per window, {short} / ours (median) |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        q = row["speed_ratio"]
        lines.append(
            f"| {row['model']} (length {row['length']}) | {row['micro_batch']} x {row['ga']} | {row['windows']} | "
            f"{row['stock_median_s']:.3f} | {row['ours_median_s']:.3f} | **{q['median']:.3f}** "
            f"({q['q1']:.3f}-{q['q3']:.3f}; {q['min']:.3f}-{q['max']:.3f}) | {row['ours_faster']} of {row['windows']} | "
            f"{row['stock_page_faults']:,.0f} / {row['ours_page_faults']:,.0f} |"
        )
    checks = [row for row in rows if row.get("loss_check")]
    if checks:
        lines += [
            "",
            "Ours' loss measurement (docs/model_losses.md): the first window's, and the later windows' re-weighing of "
            "rules that tied on the first window, as a fraction of ours' later windows.",
            "",
            "| shape | rule (decided by) | first window s | windows re-weighed | re-weighing s | fraction |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in checks:
            c = row["loss_check"]
            fraction = "n/a" if c["recheck_fraction"] is None else f"{100 * c['recheck_fraction']:.3f}%"
            first = "n/a" if c["first_window_s"] is None else f"{c['first_window_s']:.3f}"
            lines.append(
                f"| {row['model']} | {c['rule']} ({c['decided_by']}) | {first} | {c['windows_rechecked']} | "
                f"{c['recheck_s']:.4f} | {fraction} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="minilm,gpt2-small,resnet18", help=f"comma-separated, from {MODELS}")
    parser.add_argument("--windows", type=int, default=20, help="timed windows per trainer and shape")
    parser.add_argument("--warmup", type=int, default=1, help="windows of each trainer left out at the start")
    parser.add_argument("--ga", type=int, default=8, help="gradient accumulation steps")
    parser.add_argument("--micro_batch", type=int, default=None, help="override every shape's micro-batch")
    parser.add_argument("--seq_len", type=int, default=None, help="override the sequence length")
    parser.add_argument("--image_size", type=int, default=None, help="override resnet18's image side")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: wall time, synchronized")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="Trainer precision")
    parser.add_argument(
        "--first",
        choices=("stock", "gradaccum"),
        default="stock",
        help="which trainer runs the first window (to check that the order does not favour one)",
    )
    parser.add_argument(
        "--pair",
        choices=tuple(PAIRS),
        default="trainers",
        help="trainers: GradAccumTrainer against the stock Trainer; loops: the GradientAccumulator loop against "
        "Accelerate's `accumulate` loop",
    )
    parser.add_argument(
        "--allocator",
        choices=("default", "tcmalloc"),
        default="default",
        help="tcmalloc: run with tcmalloc preloaded, which keeps freed memory for reuse (see use_tcmalloc)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS_DIR / "paired_windows_cpu.json"), help="JSON path; .md beside")
    opts = parser.parse_args(argv)
    models = [m.strip() for m in opts.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed: {', '.join(MODELS)}")
    if opts.windows < 2:
        parser.error("--windows must be >= 2 (a ratio needs the stock windows before and after one of ours)")
    if opts.warmup < 0 or opts.ga < 1:
        parser.error("--warmup must be >= 0 and --ga >= 1")
    if opts.pair == "loops" and opts.first != "stock":
        parser.error("--pair loops needs --first stock (Accelerate's data-loader state is process-wide: see above)")

    if opts.allocator == "tcmalloc":  # before torch is imported: the run starts again with tcmalloc preloaded
        use_tcmalloc(sys.argv[1:] if argv is None else list(argv))
    import torch
    import transformers

    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    start = time.perf_counter()
    results, rows = [], []
    for model_name in models:
        result = run_shape(model_name, opts)
        results.append(result)
        rows.append(summarize(result, opts.warmup))
        q = rows[-1]["speed_ratio"]
        short = LABELS[opts.pair][0]
        print(f"{model_name}: speed ours / {short} {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})", flush=True)
    meta = {
        "device_kind": opts.device,
        "device": torch.cuda.get_device_name(0) if opts.device == "cuda" else platform.processor() or "cpu",
        "precision": opts.precision,
        "allocator": "tcmalloc" if _tcmalloc_loaded() else "glibc malloc",
        "first": opts.first,
        "pair": opts.pair,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "warmup": opts.warmup,
        "seconds": time.perf_counter() - start,
    }
    command = "python benchmarks/bench_paired_windows.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "command": command, "rows": rows, "raw": results}, indent=1))
    report = markdown(rows, command, meta)
    out.with_suffix(".md").write_text(report)
    print(report)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
