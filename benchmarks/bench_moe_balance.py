"""Time overhead of exact window-level MoE load balancing (`moe_load_balance="window"`) against the default
per-micro-batch term (`"micro_batch"`), in a plain `GradientAccumulator` loop on CPU.

What it measures: a random-init Mixtral (`--hidden` 64, 4 layers, 8 experts, top-2, vocab 1000, router aux coef
0.02, no jitter), synthetic token ids of random lengths in [seq_len/2, seq_len] right-padded per micro-batch,
micro-batch `--micro_batch` x `--steps_per_window` accumulation steps, SGD, `--threads` torch threads (default 2).
Each run does `--windows` optimizer steps; the first is warmup, the rest are timed (forward-only pass included for "window"). Each
configuration runs in its own subprocess (this script re-invoked with `--worker MODE`), interleaved in an ABBA order
over `--repeats` rounds (cancels a linear drift of a shared machine); the table gives the median time per optimizer
step of each mode and the ratio of medians. The "window" workers also time the forward-only pass and the rest of
the same step back to back: `1 + pass / rest` is the overhead measured within one process, which a shared machine's
changing load disturbs far less than the ratio across processes. Process CPU time per step (`time.process_time`, all
threads) is reported next to wall time: it counts the work done, not the time spent waiting for a shared core.

Results: a Markdown table on stdout and `benchmarks/results/moe_balance.{json,md}`.

Command (from the repository root, with the project's virtualenv):

    python benchmarks/bench_moe_balance.py --repeats 3 --windows 4
    python benchmarks/bench_moe_balance.py --repeats 2 --windows 3 --threads 1   # a loaded shared machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "BENCH_RESULT "
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = ("micro_batch", "window")
NUM_THREADS = 2


def run_worker(mode: str, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_gradaccum import GradientAccumulator, count_items_in_batch
    from hf_gradaccum.losses.moe import WindowRouterBalance

    torch.manual_seed(args.seed)
    config = MixtralConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq_len,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        router_jitter_noise=0.0,
        pad_token_id=0,
    )
    model = MixtralForCausalLM(config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    accumulator = GradientAccumulator(model, gradient_accumulation_steps=args.steps_per_window)
    balance = WindowRouterBalance(model) if mode == "window" else None
    gen = torch.Generator().manual_seed(args.seed + 1)

    def micro_batch() -> dict:
        lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.micro_batch,), generator=gen)
        ids = torch.randint(1, 1000, (args.micro_batch, args.seq_len), generator=gen)
        mask = (torch.arange(args.seq_len)[None, :] < lengths[:, None]).long()
        ids = ids * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    windows = [[micro_batch() for _ in range(args.steps_per_window)] for _ in range(args.windows)]
    step_times, prepare_times, step_cpu = [], [], []
    for window in windows:
        start, cpu_start = time.perf_counter(), time.process_time()
        if balance is not None:
            items = balance.prepare_window(window)
            prepare_times.append(time.perf_counter() - start)
        else:
            items = [count_items_in_batch(b, shift_labels=True) for b in window]
        for batch, n in zip(window, items, strict=True):
            loss = balance.micro_batch_loss(batch, n) if balance is not None else model(**batch).loss
            accumulator.backward(loss, num_items=n)
        accumulator.step(optimizer)
        step_times.append(time.perf_counter() - start)
        step_cpu.append(time.process_time() - cpu_start)
    timed = step_times[1:]
    result = {
        "mode": mode,
        "step_s": statistics.median(timed),
        "prepare_s": statistics.median(prepare_times[1:]) if prepare_times else 0.0,
        "step_cpu_s": statistics.median(step_cpu[1:]),
        "step_times_s": step_times,
        "prepare_times_s": prepare_times,
    }
    if prepare_times:
        # Within each window: the forward-only pass against the rest of the same step, measured back to back, so a
        # shared machine's load drifts far less between the two than between processes.
        result["in_process_overhead"] = statistics.median(
            p / (s - p) for p, s in zip(prepare_times[1:], step_times[1:], strict=True)
        )
    return result


def run_config(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode]
    for key in ("hidden", "seq_len", "micro_batch", "steps_per_window", "windows", "seed", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"worker {mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--steps_per_window", type=int, default=4)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=NUM_THREADS, help="torch threads per worker")
    args = parser.parse_args()
    for name in ("hidden", "seq_len", "micro_batch", "steps_per_window", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.windows < 2:
        parser.error("--windows must be >= 2 (the first window is warmup)")
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_worker(args.worker, args)), flush=True)
        return

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]  # ABBA
        for mode in order:
            result = run_config(mode, args)
            runs[mode].append(result)
            print(f"round {r}: {mode} {result['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    med = {m: statistics.median(x["step_s"] for x in runs[m]) for m in MODES}
    prepare = statistics.median(x["prepare_s"] for x in runs["window"])
    ratio = med["window"] / med["micro_batch"]
    in_process = statistics.median(x["in_process_overhead"] for x in runs["window"])
    cpu = {m: statistics.median(x["step_cpu_s"] for x in runs[m]) for m in MODES}
    setup = (
        f"Mixtral hidden {args.hidden}, 4 layers, 8 experts top-2, seq_len {args.seq_len}, micro-batch "
        f"{args.micro_batch} x {args.steps_per_window} steps, {args.windows - 1} timed steps x {args.repeats} "
        f"processes per mode, {args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    table = "\n".join(
        [
            f"Setup: {setup}.",
            "",
            "| mode | median wall time per optimizer step | of which the forward-only pass | median CPU time per step |",
            "|---|---|---|---|",
            f"| `micro_batch` (default) | {med['micro_batch']:.3f} s | - | {cpu['micro_batch']:.3f} s |",
            f"| `window` (exact) | {med['window']:.3f} s | {prepare:.3f} s | {cpu['window']:.3f} s |",
            f"| ratio window / micro_batch (medians over processes) | {ratio:.3f} | | {cpu['window'] / cpu['micro_batch']:.3f} |",
            f"| in-process: 1 + forward-only pass / rest of the same step (median) | {1 + in_process:.3f} | | |",
        ]
    )
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "moe_balance.md").write_text(table + "\n")
    payload = {
        "setup": setup,
        "args": vars(args),
        "runs": runs,
        "median_step_s": med,
        "median_prepare_s": prepare,
        "in_process_ratio": 1 + in_process,
        "median_step_cpu_s": cpu,
        "cpu_ratio": cpu["window"] / cpu["micro_batch"],
        "ratio": ratio,
    }
    (RESULTS_DIR / "moe_balance.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
