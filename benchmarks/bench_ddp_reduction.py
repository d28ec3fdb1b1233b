"""Time per optimizer step under DDP: one reduction per window (this project) vs DDP's own.

Run under a 2-process launch (gloo on CPU), from the repository root:

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml benchmarks/bench_ddp_reduction.py

Three ways to accumulate N micro-batches per optimizer step on each rank, timed in the same run:

* `every_micro_batch`: DDP's backward on every micro-batch (no `no_sync`), so DDP all-reduces every gradient
  bucket N times per step: what a hand-written loop that forgets `no_sync` does.
* `ddp_no_sync`: Accelerate's `accumulator.accumulate(model)` idiom: `no_sync` on N-1 micro-batches, DDP's
  bucketed (overlapped) all-reduce on the last one. The reduction count is right, but the gradients accumulate in
  the parameters' dtype and the update is a mean of per-micro-batch means (not item-weighted).
* `gradaccum_window_end`: `GradientAccumulator`: `no_sync` on every micro-batch, gradients folded into the flat
  fp32 buffer, one blocking all-reduce of the buffer (plus one small count vector) after the window's last
  backward, item-weighted.

Model: a BERT-shaped `BertForSequenceClassification` (random init; `--hidden`, `--layers`, vocab 30522, so the
gradient is dominated by the embedding table as in real BERT fine-tuning), micro-batch `--micro` x `--seq_len`
synthetic tokens, SGD. The methods are interleaved per repetition (A B C, C B A, ...) so drift of the shared
machine falls on all of them alike; medians over `--repeats` windows after one warm-up window each. DDP's own
all-reduces are counted with a communication hook, the accumulator's with its counters (one per flat buffer plus
the count vector).

Writes `benchmarks/results/ddp_reduction.{json,md}` (rank 0) and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from transformers import BertConfig, BertForSequenceClassification

from hf_gradaccum import GradientAccumulator

RESULTS_DIR = Path(__file__).resolve().parent / "results"
METHODS = ("every_micro_batch", "ddp_no_sync", "gradaccum_window_end")
OURS = ("gradaccum_window_end",)


class AllReduceCounter:
    """DDP communication hook: the default all-reduce (average), counted."""

    def __init__(self) -> None:
        self.calls = 0

    def hook(self, state, bucket):
        self.calls += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def make_batches(num: int, micro: int, seq_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1000, 30522, (micro, seq_len), generator=g),
            "attention_mask": torch.ones(micro, seq_len, dtype=torch.long),
            "labels": torch.randint(0, 2, (micro,), generator=g),
        }
        for _ in range(num)
    ]


def one_window(method: str, model, optimizer, accumulator: GradientAccumulator | None, batches) -> None:
    if accumulator is not None:
        for batch in batches:
            with accumulator.accumulate(model):
                accumulator.backward(model(**batch).loss, num_items=len(batch["labels"]))
        accumulator.step(optimizer)
        return
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sync = last or method == "every_micro_batch"
        with model.no_sync() if not sync else contextlib.nullcontext():
            (model(**batch).loss / len(batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4, 16], help="Accumulation steps N to time.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed windows per method and N (after 1 warm-up).")
    parser.add_argument("--micro", type=int, default=4, help="Micro-batch size per rank.")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    # One rank per core on a 2-core machine: more threads per rank would only fight over the cores.
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    if accelerator.num_processes < 2:
        raise SystemExit(
            "Run under a multi-process launch: accelerate launch --config_file "
            "configs/accelerate/cpu_2proc.yaml benchmarks/bench_ddp_reduction.py"
        )
    config = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(128, args.seq_len),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    models, optimizers, counters, accumulators = {}, {}, {}, {}
    for method in METHODS:
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        counters[method] = AllReduceCounter()
        model.register_comm_hook(None, counters[method].hook)
        models[method], optimizers[method] = model, optimizer
    num_params = sum(p.numel() for p in models["gradaccum_window_end"].parameters())

    rows = []
    for steps in args.steps:
        for method in METHODS:
            counters[method].calls = 0
        # A fresh accumulator per N (its window length is fixed at construction).
        for acc in accumulators.values():
            acc.remove_hooks()
        accumulators = {m: GradientAccumulator(models[m], steps) for m in OURS}
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        comm_per_window: dict[str, float] = {}
        seed = 100 * steps + accelerator.process_index
        for rep in range(args.repeats + 1):
            order = METHODS if rep % 2 == 0 else METHODS[::-1]
            for method in order:
                batches = make_batches(steps, args.micro, args.seq_len, seed + rep)
                acc = accumulators.get(method)
                before = counters[method].calls + (acc.num_collectives if acc is not None else 0)
                dist.barrier()
                start = time.perf_counter()
                one_window(method, models[method], optimizers[method], acc, batches)
                dist.barrier()
                elapsed = time.perf_counter() - start
                after = counters[method].calls + (acc.num_collectives if acc is not None else 0)
                if rep > 0:  # the first window of each method warms up allocators and gloo
                    times[method].append(elapsed)
                    comm_per_window[method] = after - before
        base = statistics.median(times["every_micro_batch"])
        no_sync = statistics.median(times["ddp_no_sync"])
        for method in METHODS:
            median = statistics.median(times[method])
            rows.append(
                {
                    "N": steps,
                    "method": method,
                    "s_per_step": median,
                    "min_s_per_step": min(times[method]),
                    "ratio_vs_every_micro_batch": median / base,
                    "ratio_vs_ddp_no_sync": median / no_sync,
                    # Robust to the shared machine's drift: each repetition runs every method back to back.
                    "paired_ratio_vs_ddp_no_sync": statistics.median(
                        t / b for t, b in zip(times[method], times["ddp_no_sync"], strict=True)
                    ),
                    "all_reduces_per_step": comm_per_window[method],
                    "per_run_s": times[method],
                }
            )
        accelerator.print(
            f"N={steps}: " + ", ".join(f"{r['method']} {r['s_per_step']:.3f} s" for r in rows[-len(METHODS) :])
        )

    if accelerator.is_main_process:
        meta = {
            "command": "accelerate launch --config_file configs/accelerate/cpu_2proc.yaml "
            "benchmarks/bench_ddp_reduction.py "
            + " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
            "world_size": accelerator.num_processes,
            "backend": dist.get_backend(),
            "trainable_params": num_params,
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            **vars(args),
        }
        lines = [
            "| N | method | s / optimizer step (median) | min | ratio vs every micro-batch | ratio vs DDP no_sync "
            "| paired ratio vs DDP no_sync | all-reduces per step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['N']} | {r['method']} | {r['s_per_step']:.3f} | {r['min_s_per_step']:.3f} "
                f"| {r['ratio_vs_every_micro_batch']:.2f} "
                f"| {r['ratio_vs_ddp_no_sync']:.2f} | {r['paired_ratio_vs_ddp_no_sync']:.2f} "
                f"| {r['all_reduces_per_step']:g} |"
            )
        table = "\n".join(lines)
        header = (
            f"# DDP: one reduction per window vs DDP's own\n\nCommand: `{meta['command']}`\n\n"
            f"{meta['world_size']} processes ({meta['backend']}), BERT hidden {args.hidden} x {args.layers} layers "
            f"({num_params / 1e6:.1f}M trainable parameters), micro-batch {args.micro} x {args.seq_len} tokens per "
            f"rank, SGD, torch {torch.__version__}, {meta['machine']}; medians (and minima) of "
            f"{args.repeats} windows; ratios of medians, and the paired ratio: the median over repetitions of "
            "each method's time over DDP no_sync's in the same repetition (they run back to back).\n\n"
            "All-reduces: DDP bucket all-reduces counted by a comm hook; for gradaccum the accumulator's own "
            "collectives (the flat buffer and the count vector).\n\n"
        )
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "ddp_reduction.md").write_text(header + table + "\n")
        (RESULTS_DIR / "ddp_reduction.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(table)


if __name__ == "__main__":
    main()
