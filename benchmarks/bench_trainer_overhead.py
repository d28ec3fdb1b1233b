"""Overhead of `GradAccumTrainer` against the stock `transformers.Trainer`, in time and peak memory, on CPU.

What it measures, on a MiniLM-shaped BERT (`BertForSequenceClassification`, hidden 384, 6 layers, 12 heads,
intermediate 1536, vocab 30522, 2 labels, random init from a fixed seed, default dropout), sequence length 128,
synthetic token ids and labels from a fixed seed in a real `datasets.Dataset`, AdamW (`--optim`, the
`TrainingArguments` default `adamw_torch_fused` unless told), `torch.set_num_threads(2)`:

1. Overhead at equal settings: `GradAccumTrainer` vs `Trainer`, micro-batch 8 x 8 accumulation steps.
   * time per sample: each run does `--steps` optimizer steps; the first is warmup and the rest are timed from the
     `on_step_end` of step 1 to the `on_step_end` of the last step (so data loading, forward/backward, window end,
     clipping, optimizer step and `zero_grad` all count). Targets: ratio of medians <= 1.05.
   * peak RSS: `resource.getrusage(RUSAGE_SELF).ru_maxrss` of the worker process. Target: ratio of medians <= 1.03.
   The two configurations are interleaved (stock, GA, GA, stock, stock, GA, ...: an ABBA order, which also cancels a
   linear drift of the machine) for `--repeats` rounds; the table reports medians and the ratio of medians.
2. Peak memory of batch 64 x 1 vs 8 x 8 vs 8 x 1, with `GradAccumTrainer` and, for reference, the stock `Trainer`
   (`--mem_steps` optimizer steps each, one run each; >= 2 steps so the AdamW state exists during a backward).

Every configuration runs in its own subprocess (this script re-invoked with `--worker CONFIG`, which prints one
JSON line), so peak RSS is per configuration. Besides the peak, each worker reports its RSS just before
`trainer.train()` (model, data and imports) and the peak increase during training (`delta`), which is the part the
trainer can influence.

Results: a Markdown table on stdout, and `benchmarks/results/trainer_overhead.json` and `.md`.

Command (from the repository root, with the project's virtualenv; about 6 minutes on an idle 2-core machine):

    python benchmarks/bench_trainer_overhead.py --steps 6 --repeats 5 --seq_len 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "BENCH_RESULT "
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# name -> (trainer, micro-batch, accumulation steps)
CONFIGS: dict[str, tuple[str, int, int]] = {
    "stock_8x8": ("stock", 8, 8),
    "gradaccum_8x8": ("gradaccum", 8, 8),
    "gradaccum_64x1": ("gradaccum", 64, 1),
    "gradaccum_8x1": ("gradaccum", 8, 1),
    "stock_64x1": ("stock", 64, 1),
    "stock_8x1": ("stock", 8, 1),
}
TIMING_PAIR = ("stock_8x8", "gradaccum_8x8")
MEMORY_CONFIGS = ("gradaccum_64x1", "gradaccum_8x1", "stock_64x1", "stock_8x1")
NUM_THREADS = 2
TIME_TARGET = 1.05
RSS_TARGET = 1.03


# ---------------------------------------------------------------------------------------------------- worker
def _current_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def run_worker(config: str, steps: int, seq_len: int, optim: str, seed: int) -> dict:
    """Train `steps` optimizer steps of `config` in this process and return its measurements."""
    import numpy as np
    import torch

    torch.set_num_threads(NUM_THREADS)
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    hf_logging.set_verbosity_error()
    kind, micro, accum = CONFIGS[config]

    # Same data for every configuration: enough rows for `steps` windows of 64 samples.
    rng = np.random.default_rng(seed)
    rows = steps * 64
    input_ids = rng.integers(1000, 30522, size=(rows, seq_len), dtype=np.int64)
    input_ids[:, 0] = 101  # [CLS]
    input_ids[:, -1] = 102  # [SEP]
    dataset = Dataset.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": np.ones((rows, seq_len), dtype=np.int64),
            "labels": rng.integers(0, 2, size=rows, dtype=np.int64),
        }
    ).with_format("torch")

    torch.manual_seed(seed)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=1536,
            num_labels=2,
        )
    )

    args_cls, trainer_cls = (
        (GradAccumArguments, GradAccumTrainer) if kind == "gradaccum" else (TrainingArguments, Trainer)
    )
    output_dir = tempfile.mkdtemp(prefix="bench_trainer_overhead_")
    named = {"batchnorm_statistics": "micro_batch"} if kind == "gradaccum" else {}  # speed: the stock statistics
    args = args_cls(
        **named,
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        max_steps=steps,
        learning_rate=5e-5,
        weight_decay=0.01,
        lr_scheduler_type="constant",
        optim=optim,
        max_grad_norm=1.0,
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.train_begin = None
            self.step_ends: list[float] = []
            self.rss_after_step: list[int] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())
            self.rss_after_step.append(_current_rss_kib())

    clock = StepClock()
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=[clock])

    load_before = os.getloadavg()[0]
    rss_before = _current_rss_kib()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    ends = clock.step_ends
    step_times = [ends[0] - clock.train_begin] + [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
    samples_per_step = micro * accum
    timed_steps = len(ends) - 1
    s_per_sample = (ends[-1] - ends[0]) / (timed_steps * samples_per_step) if timed_steps > 0 else None
    return {
        "config": config,
        "trainer": kind,
        "micro_batch": micro,
        "accumulation_steps": accum,
        "seq_len": seq_len,
        "optim": optim,
        "optimizer_steps": len(ends),
        "timed_steps": timed_steps,
        "step_times_s": step_times,
        "s_per_sample": s_per_sample,
        "peak_rss_kib": peak,
        "peak_rss_before_train_kib": peak_before,
        "rss_before_train_kib": rss_before,
        "rss_after_step_kib": clock.rss_after_step,
        "train_peak_delta_kib": peak - rss_before,
        "num_params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        # Other processes on the machine show up here (1-minute load average; this run alone is ~2).
        "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
    }


# ---------------------------------------------------------------------------------------------------- parent
def _cpu_busy_s() -> float:
    """CPU seconds spent busy (all cores, all processes) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_idle(max_wait_s: float, threshold_cores: float) -> tuple[float, float]:
    """Wait (at most `max_wait_s`) until other processes use less than `threshold_cores` over a 1 s window."""
    t0 = time.perf_counter()
    while True:
        b0, w0 = _cpu_busy_s(), time.perf_counter()
        time.sleep(1.0)
        busy = (_cpu_busy_s() - b0) / (time.perf_counter() - w0)
        waited = time.perf_counter() - t0
        if busy < threshold_cores or waited >= max_wait_s:
            return waited, busy


def launch(config: str, steps: int, opts: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        config,
        "--steps",
        str(steps),
        "--seq_len",
        str(opts.seq_len),
        "--optim",
        opts.optim,
        "--seed",
        str(opts.seed),
    ]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(NUM_THREADS),
        MKL_NUM_THREADS=str(NUM_THREADS),
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    waited, idle_busy = wait_for_idle(opts.max_idle_wait_s, opts.max_foreign_cores) if opts.max_idle_wait_s else (0, 0)
    busy0, child0 = _cpu_busy_s(), _children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    # CPU used by *other* processes while this worker ran, in cores: the benchmark's noise on a shared machine.
    foreign = max(0.0, ((_cpu_busy_s() - busy0) - (_children_cpu_s() - child0)) / wall)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"worker {config} failed (exit code {proc.returncode})")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_wall_s"] = wall
    result["foreign_cpu_cores"] = foreign
    result["waited_for_idle_s"] = waited
    sps = result["s_per_sample"]
    print(
        f"  {config:<15} s/sample={'n/a' if sps is None else f'{sps:.4f}'} "
        f"peak={result['peak_rss_kib'] / 1024:.0f} MiB (train delta {result['train_peak_delta_kib'] / 1024:.0f} MiB) "
        f"steps={[round(t, 2) for t in result['step_times_s']]} wall={result['process_wall_s']:.0f}s "
        f"foreign={foreign:.2f} cores (waited {waited:.0f}s, {idle_busy:.2f} busy)",
        file=sys.stderr,
        flush=True,
    )
    return result


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for config, results in runs.items():
        kind, micro, accum = CONFIGS[config]
        summary[config] = {
            "trainer": kind,
            "micro_batch": micro,
            "accumulation_steps": accum,
            "runs": len(results),
            "s_per_sample_median": _median([r["s_per_sample"] for r in results]),
            "s_per_sample_all": [r["s_per_sample"] for r in results],
            # Robust to a burst of load from other processes: median of every timed step of every run.
            "s_per_sample_step_median": _median(
                [t / (micro * accum) for r in results for t in r["step_times_s"][1:]] or [None]
            ),
            "peak_rss_mib_median": _median([r["peak_rss_kib"] / 1024 for r in results]),
            "peak_rss_mib_all": [r["peak_rss_kib"] / 1024 for r in results],
            "rss_before_train_mib_median": _median([r["rss_before_train_kib"] / 1024 for r in results]),
            "train_peak_delta_mib_median": _median([r["train_peak_delta_kib"] / 1024 for r in results]),
        }
    for s in summary.values():
        ref = summary.get(f"stock_{s['micro_batch']}x{s['accumulation_steps']}")
        if ref is None:
            continue
        if s["s_per_sample_median"] and ref["s_per_sample_median"]:
            s["time_ratio_vs_stock"] = s["s_per_sample_median"] / ref["s_per_sample_median"]
            s["step_median_time_ratio_vs_stock"] = s["s_per_sample_step_median"] / ref["s_per_sample_step_median"]
        s["rss_ratio_vs_stock"] = s["peak_rss_mib_median"] / ref["peak_rss_mib_median"]
        s["delta_ratio_vs_stock"] = s["train_peak_delta_mib_median"] / ref["train_peak_delta_mib_median"]
    return summary


def _fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def markdown(summary: dict[str, dict], meta: dict, verdict: dict) -> str:
    lines = [
        "# GradAccumTrainer vs stock Trainer: overhead on CPU",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Model: MiniLM-shaped `BertForSequenceClassification` ({meta['num_params'] / 1e6:.1f}M params), "
        f"seq_len {meta['seq_len']}, optim `{meta['optim']}`, torch threads {NUM_THREADS}, "
        f"{meta['cpu_count']} CPU cores, torch {meta['torch']}, transformers {meta['transformers']}.",
        f"Timing: {meta['steps']} optimizer steps per run, first one warmup; 8x8 pair interleaved "
        f"{meta['repeats']}x (ABBA); medians. Memory-only configurations: {meta['mem_steps']} steps, one run each.",
        "",
        "| config | micro x steps | s/sample | peak RSS MiB | ratio vs stock (time) | ratio vs stock (peak RSS) "
        "| s/sample (median step) | RSS before train MiB | train delta MiB | delta ratio vs stock | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = list(TIMING_PAIR) + [c for c in MEMORY_CONFIGS if c in summary]
    for config in order:
        s = summary[config]
        lines.append(
            f"| {config} | {s['micro_batch']} x {s['accumulation_steps']} | {_fmt(s['s_per_sample_median'], '.4f')} "
            f"| {s['peak_rss_mib_median']:.0f} | {_fmt(s.get('time_ratio_vs_stock'), '.3f')} "
            f"| {_fmt(s.get('rss_ratio_vs_stock'), '.3f')} | {_fmt(s['s_per_sample_step_median'], '.4f')} "
            f"| {s['rss_before_train_mib_median']:.0f} | {s['train_peak_delta_mib_median']:.0f} "
            f"| {_fmt(s.get('delta_ratio_vs_stock'), '.3f')} | {s['runs']} |"
        )
    lines += [
        "",
        f"Targets (8 x 8, GradAccumTrainer / stock): time ratio <= {TIME_TARGET}: "
        f"{_fmt(verdict['time_ratio'], '.3f')} -> {'met' if verdict['time_met'] else 'MISSED'}; "
        f"peak RSS ratio <= {RSS_TARGET}: {_fmt(verdict['rss_ratio'], '.3f')} -> "
        f"{'met' if verdict['rss_met'] else 'MISSED'}.",
        "",
        "Per-run s/sample (8 x 8): "
        + "; ".join(f"{c}: {[round(v, 4) for v in summary[c]['s_per_sample_all']]}" for c in TIMING_PAIR),
        "",
        "`s/sample`: per run, timed steps' wall time / samples, median over runs (memory-only configurations: one run "
        "with one timed step, indicative only); `s/sample (median step)`: median of all timed steps of all runs / "
        "samples per step. `peak RSS`: the worker's `ru_maxrss`; `RSS before train`: its VmRSS just before "
        "`trainer.train()` (imports, model, data); `train delta` = peak - RSS before train. "
        f"1-minute load average during the runs: {meta['loadavg_range'][0]:.1f} to {meta['loadavg_range'][1]:.1f} "
        "(the benchmark alone is ~2); CPU used by other processes during a kept run: at most "
        f"{meta['foreign_cpu_cores_max']:.2f} cores (per run in the JSON, `foreign_cpu_cores`).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per timing run (first is warmup)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the 8x8 stock/GA pair")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--mem_steps", type=int, default=2, help="optimizer steps of the memory-only configurations")
    parser.add_argument("--optim", default="adamw_torch_fused", help="TrainingArguments.optim (an AdamW variant)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max_foreign_cores",
        type=float,
        default=0.25,
        help="other processes' CPU use (in cores) above which a timing run is redone (see --retries)",
    )
    parser.add_argument("--retries", type=int, default=1, help="redos of a timing run disturbed by other processes")
    parser.add_argument(
        "--max_idle_wait_s", type=float, default=20.0, help="wait up to this long for an idle CPU before each run"
    )
    parser.add_argument("--time_budget_s", type=float, default=540.0, help="no redos once this much time has passed")
    parser.add_argument("--skip_memory", action="store_true", help="only run the 8x8 timing pair")
    parser.add_argument("--results_dir", default=str(RESULTS_DIR))
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.worker:
        result = run_worker(opts.worker, opts.steps, opts.seq_len, opts.optim, opts.seed)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return

    if opts.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warmup)")
    t_start = time.perf_counter()
    runs: dict[str, list[dict]] = {c: [] for c in TIMING_PAIR}
    for r in range(opts.repeats):
        order = TIMING_PAIR if r % 2 == 0 else TIMING_PAIR[::-1]
        print(f"round {r + 1}/{opts.repeats}: {' -> '.join(order)}", file=sys.stderr, flush=True)
        for config in order:
            attempts = [launch(config, opts.steps, opts)]
            while (
                attempts[-1]["foreign_cpu_cores"] > opts.max_foreign_cores
                and len(attempts) <= opts.retries
                and time.perf_counter() - t_start < opts.time_budget_s
            ):
                print(f"  (other processes used the CPU: redoing {config})", file=sys.stderr, flush=True)
                attempts.append(launch(config, opts.steps, opts))
            best = min(attempts, key=lambda r: r["foreign_cpu_cores"])
            best["discarded_attempts"] = [
                {"s_per_sample": a["s_per_sample"], "foreign_cpu_cores": a["foreign_cpu_cores"]}
                for a in attempts
                if a is not best
            ]
            runs[config].append(best)
    if not opts.skip_memory:
        print("memory configurations", file=sys.stderr, flush=True)
        for config in MEMORY_CONFIGS:
            runs[config] = [launch(config, opts.mem_steps, opts)]

    summary = summarize(runs)
    ga = summary["gradaccum_8x8"]
    time_ratio, rss_ratio = ga.get("time_ratio_vs_stock"), ga["rss_ratio_vs_stock"]
    verdict = {
        "time_ratio": time_ratio,
        "time_target": TIME_TARGET,
        "time_met": time_ratio is not None and time_ratio <= TIME_TARGET,
        "rss_ratio": rss_ratio,
        "rss_target": RSS_TARGET,
        "rss_met": rss_ratio <= RSS_TARGET,
    }
    import torch
    import transformers

    first = runs["stock_8x8"][0]
    meta = {
        "command": "python benchmarks/bench_trainer_overhead.py " + " ".join(sys.argv[1:]),
        "steps": opts.steps,
        "repeats": opts.repeats,
        "mem_steps": opts.mem_steps,
        "seq_len": opts.seq_len,
        "optim": opts.optim,
        "seed": opts.seed,
        "num_params": first["num_params"],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "total_wall_s": time.perf_counter() - t_start,
        "foreign_cpu_cores_max": max(r["foreign_cpu_cores"] for rs in runs.values() for r in rs),
        "loadavg_range": [
            min(x for rs in runs.values() for r in rs for x in r["loadavg_1m_before_after"]),
            max(x for rs in runs.values() for r in rs for x in r["loadavg_1m_before_after"]),
        ],
    }
    md = markdown(summary, meta, verdict)
    print(md)
    results_dir = Path(opts.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "verdict": verdict, "summary": summary, "runs": runs}
    (results_dir / "trainer_overhead.json").write_text(json.dumps(payload, indent=2) + "\n")
    (results_dir / "trainer_overhead.md").write_text(md)
    print(f"wrote {results_dir / 'trainer_overhead.json'} and .md ({meta['total_wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
