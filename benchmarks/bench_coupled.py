#!/usr/bin/env python
"""Peak memory and time of the coupled-loss mode (gradient caching) against the large batch and against plain
accumulation, each configuration in its own process (so each peak is its own).

Model: a random-init BERT encoder (4 layers, hidden 256, 4 heads), multiple-negatives ranking loss on
(anchor, positive) pairs of `--seq_len` tokens; one step = a batch of `--batch` pairs.

- `large_batch`: one forward/backward of the whole batch;
- `coupled`:     `--steps` micro-batches, `CoupledLoss` (pass 1 without graph, pass 2 with), exact;
- `plain`:       `--steps` micro-batches, plain item-weighted accumulation (not the same objective);
- `forward_no_grad`: the `--steps` micro-batches' forwards without a graph, the coupled mode's pass 1: its floor is
  plain accumulation plus (steps - 1) / steps of this (the first micro-batch keeps its pass-1 graph);
- `trainer_coupled` / `trainer_plain`: the same two through `GradAccumTrainer` (`coupled_loss=...`, or each
  micro-batch's own in-batch loss), timed from one `on_step_end` to the next.

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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("large_batch", "coupled", "plain", "forward_no_grad", "trainer_coupled", "trainer_plain")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_one(mode: str, args: argparse.Namespace) -> dict:
    from transformers import BertConfig, BertModel

    from hf_gradaccum import GradientAccumulator
    from hf_gradaccum.losses.coupled import ranking_coupled_loss

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
    if mode.startswith("trainer_"):
        return run_trainer(mode, args, model, coupled, data)
    accumulator = GradientAccumulator(model, args.steps) if mode != "large_batch" else None

    def step() -> None:
        if mode == "large_batch":
            coupled.window_loss(model, [data]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elif mode == "forward_no_grad":
            with torch.no_grad():
                for mb in micro_batches:
                    coupled.window_loss(model, [mb])
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


def run_trainer(mode: str, args: argparse.Namespace, model: torch.nn.Module, coupled: Any, data: dict) -> dict:
    """Time `GradAccumTrainer` steps: the coupled mode, or plain accumulation of each micro-batch's in-batch loss."""
    import tempfile

    from transformers import TrainerCallback

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    class PlainInBatchTrainer(GradAccumTrainer):
        def count_micro_batch_items(self, inputs: dict) -> float:
            return coupled.num_items_fn(inputs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            loss = coupled.window_loss(model, [inputs])
            return (loss, {"loss": loss}) if return_outputs else loss

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.wall, self.cpu = [time.perf_counter()], [time.process_time()]

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    device = torch.device(args.device)
    rows = [{k: v[i] for k, v in data.items()} for i in range(args.batch)] * (args.repeats + 1)
    train_args = GradAccumArguments(
        tempfile.mkdtemp(prefix="bench_coupled_"),
        per_device_train_batch_size=args.batch // args.steps,
        gradient_accumulation_steps=args.steps,
        max_steps=args.repeats + 1,
        learning_rate=1e-3,
        optim="sgd",
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    clock = Clock()
    if mode == "trainer_coupled":
        trainer = GradAccumTrainer(model=model, args=train_args, train_dataset=rows, coupled_loss=coupled)
    else:
        trainer = PlainInBatchTrainer(model=model, args=train_args, train_dataset=rows)
    trainer.add_callback(clock)
    base = rss_mib()
    trainer.train()
    walls = sorted(b - a for a, b in zip(clock.wall[1:-1], clock.wall[2:], strict=True))
    cpus = sorted(b - a for a, b in zip(clock.cpu[1:-1], clock.cpu[2:], strict=True))
    return {
        "mode": mode,
        "peak_mib_above_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
        "seconds_per_step": walls[len(walls) // 2],
        "cpu_seconds_per_step": cpus[len(cpus) // 2],
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
    plain = {r["mode"]: r for r in rows}
    print(
        "| mode | peak MiB above start | s / step (median) | CPU s / step (median) | CPU time vs plain |\n"
        "|---|---:|---:|---:|---:|"
    )
    for r in rows:
        # the loop's modes against the loop's plain accumulation, the Trainer's against the Trainer's
        ref = plain.get("trainer_plain" if r["mode"].startswith("trainer_") else "plain")
        ratio = f"{r['cpu_seconds_per_step'] / ref['cpu_seconds_per_step']:.2f}" if ref else "-"
        print(
            f"| {r['mode']} | {r['peak_mib_above_start']:,.0f} | {r['seconds_per_step']:.2f} | "
            f"{r['cpu_seconds_per_step']:.2f} | {ratio} |"
        )
    if "plain" in plain and "forward_no_grad" in plain:
        extra = plain["forward_no_grad"]["cpu_seconds_per_step"] * (args.steps - 1) / args.steps
        floor = (plain["plain"]["cpu_seconds_per_step"] + extra) / plain["plain"]["cpu_seconds_per_step"]
        print(
            f"\nfloor of the coupled mode (plain + {args.steps - 1}/{args.steps} of the no-graph forwards): {floor:.2f}"
        )


if __name__ == "__main__":
    main()
