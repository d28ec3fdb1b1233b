#!/usr/bin/env python
"""Peak memory and time of the coupled-loss mode (gradient caching) against the large batch and against plain
accumulation, each configuration in its own process (so each peak is its own).

Model: a random-init BERT encoder (4 layers, hidden 256, 4 heads), multiple-negatives ranking loss on
(anchor, positive) pairs of `--seq_len` tokens; one step = a batch of `--batch` pairs.

- `large_batch`: one forward/backward of the whole batch;
- `coupled`:     `--steps` micro-batches, `CoupledLoss` (pass 1 without graph, pass 2 with), exact;
- `plain`:       `--steps` micro-batches, plain item-weighted accumulation (not the same objective).

Memory: peak RSS of the process minus its RSS before the first step (`ru_maxrss`, CPU), or the CUDA peak. Time: the
median step after one warm-up step, wall clock and process CPU time (steadier on a shared machine; with `--threads 1`
it is the compute itself).

    python benchmarks/bench_coupled.py --batch 64 --steps 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("large_batch", "coupled", "plain")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_one(mode: str, args: argparse.Namespace) -> dict:
    from transformers import BertConfig, BertModel

    from hf_gradaccum import GradientAccumulator
    from hf_gradaccum.adapters.coupled import ranking_coupled_loss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = BertConfig(
        vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
    )
    model = BertModel(config, add_pooling_layer=False).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    coupled = ranking_coupled_loss(scale=20.0)
    g = torch.Generator().manual_seed(1)
    data = {
        f"{side}_{k}": v
        for side in ("anchor", "positive")
        for k, v in (
            ("input_ids", torch.randint(1, 8000, (args.batch, args.seq_len), generator=g)),
            ("attention_mask", torch.ones(args.batch, args.seq_len, dtype=torch.long)),
        )
    }
    data = {k: v.to(device) for k, v in data.items()}
    micro = args.batch // args.steps
    micro_batches = [{k: v[i : i + micro] for k, v in data.items()} for i in range(0, args.batch, micro)]
    accumulator = GradientAccumulator(model, args.steps) if mode != "large_batch" else None

    def step() -> None:
        if mode == "large_batch":
            coupled.window_loss(model, [data]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elif mode == "coupled":
            coupled.accumulate_window(accumulator, model, micro_batches)
            accumulator.step(optimizer)
        else:
            for mb in micro_batches:
                accumulator.backward(coupled.window_loss(model, [mb]), micro)
            accumulator.step(optimizer)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mib()
    times, cpu_times = [], []
    for _ in range(args.repeats + 1):  # the first step warms up (allocations, optimizer state)
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20 - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    timed, cpu = sorted(times[1:]), sorted(cpu_times[1:])
    return {
        "mode": mode,
        "peak_mib_above_start": peak,
        "seconds_per_step": timed[len(timed) // 2],
        "cpu_seconds_per_step": cpu[len(cpu) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch % args.steps:
        raise SystemExit(f"`--batch` ({args.batch}) must be a multiple of `--steps` ({args.steps}).")
    if args.only:
        print(json.dumps(run_one(args.only, args)))
        return
    rows = []
    for mode in args.modes:
        out = subprocess.run([sys.executable, *sys.argv, "--only", mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"batch {args.batch} = {args.batch // args.steps} x {args.steps}, seq_len {args.seq_len}, {args.device}")
    plain = next((r for r in rows if r["mode"] == "plain"), None)
    print(
        "| mode | peak MiB above start | s / step (median) | CPU s / step (median) | CPU time vs plain |\n"
        "|---|---:|---:|---:|---:|"
    )
    for r in rows:
        ratio = f"{r['cpu_seconds_per_step'] / plain['cpu_seconds_per_step']:.2f}" if plain else "-"
        print(
            f"| {r['mode']} | {r['peak_mib_above_start']:,.0f} | {r['seconds_per_step']:.2f} | "
            f"{r['cpu_seconds_per_step']:.2f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
