"""Mixed precision under accumulation: what an fp16 overflow costs, and what the fp32 buffers cost under bf16.

From the repository root, with the project's virtualenv (about 3 minutes on an idle 2-core CPU):

    python benchmarks/bench_mixed_precision.py

Part 1, wasted micro-batches per overflow (`overflow_policy="skip"` vs `"recompute"`). An fp16 run on CPU (autocast
float16, fp32 master weights, `DynamicLossScaler` starting at 2**16 with a short growth interval so the scale keeps
climbing back into overflow, as it does in real runs) of a small MLP regressor, `--windows` windows of `--steps`
micro-batches. Overflows are also injected: a few micro-batches hold an outlier target whose scaled gradient exceeds
fp16's range at high scales but not at low ones (so they are real fp16 overflows, not NaNs). Both policies see
exactly the same micro-batch stream. A micro-batch is *wasted* when its forward/backward was computed but did not
end up in an applied optimizer step; the table reports wasted micro-batches per overflow event and samples that
never reached an update.

Part 2, time of the fp32 accumulation buffers under bf16. A BERT-shaped classifier whose parameters are bf16
(`--bert_hidden`, `--bert_layers`), micro-batch 4 x 64 tokens, 8 micro-batches per step, AdamW: stock accumulation
(`(loss / N).backward()` into the bf16 `.grad`) vs `GradientAccumulator` (fp32 flat buffer, item weighting),
alternating windows in one process (ABBA), medians. The gradient error vs an fp64 copy of the same window is
reported too, which is what the time buys.

Writes `benchmarks/results/mixed_precision.{json,md}` and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from hf_gradaccum import DynamicLossScaler, GradientAccumulator

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------------------------------- part 1
def overflow_stream(windows: int, steps: int, micro: int, outlier_every: int, seed: int):
    """Micro-batches of (x, y) for a regression; every `outlier_every`-th micro-batch holds one target of 300."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(16, 1, generator=g)
    stream = []
    for index in range(windows * steps):
        x = torch.randn(micro, 16, generator=g)
        y = x @ w_true + 0.1 * torch.randn(micro, 1, generator=g)
        if outlier_every and index % outlier_every == outlier_every - 1:
            y[0] = 300.0
        stream.append((x, y))
    return stream


def run_policy(policy: str, stream, steps: int, args) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=args.growth_interval)
    accumulator = GradientAccumulator(model, steps, loss_scaler=scaler, overflow_policy=policy)
    computed = 0
    used = 0
    unused_samples = 0
    window_samples = 0
    window_computed = 0

    for x, y in stream:

        def compute_loss(x=x, y=y):
            nonlocal window_computed
            window_computed += 1
            with torch.autocast("cpu", dtype=torch.float16):
                prediction = model(x)
            return F.mse_loss(prediction.float(), y)

        accumulator.accumulate_micro_batch(compute_loss, num_items=len(y))
        window_samples += len(y)
        if accumulator.sync_gradients:
            result = accumulator.step(optimizer)
            computed += window_computed
            if result.applied:
                used += steps  # exactly one contribution per micro-batch of the window made it into the update
            else:
                unused_samples += window_samples
            window_computed = window_samples = 0
    overflows = scaler.num_overflows
    wasted = computed - used
    return {
        "policy": policy,
        "micro_batches": len(stream),
        "forward_backward_passes": computed,
        "overflow_events": overflows,
        "applied_steps": accumulator.applied_steps,
        "skipped_steps": int(sum(accumulator.skipped_steps.values())),
        "recomputed_micro_batches": accumulator.recomputed_micro_batches,
        "wasted_micro_batches": wasted,
        "wasted_per_overflow": wasted / overflows if overflows else 0.0,
        "samples_never_in_an_update": unused_samples,
        "final_scale": scaler.scale,
    }


# ---------------------------------------------------------------------------------------------------- part 2
def bf16_model(hidden: int, layers: int) -> BertForSequenceClassification:
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def bf16_window(method: str, model, optimizer, accumulator, batches) -> None:
    if method == "gradaccum":
        for batch in batches:
            accumulator.backward(model(**batch).loss, num_items=len(batch["labels"]))
        accumulator.step(optimizer)
    else:
        for batch in batches:
            (model(**batch).loss / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def gradient_error(model64, model_bf16, batches, method: str) -> float:
    """Relative error of one window's accumulated gradient vs the fp64 gradient of the same samples."""
    model64.zero_grad(set_to_none=True)
    for batch in batches:
        (model64(**batch).loss / len(batches)).backward()
    reference = torch.cat([p.grad.flatten() for p in model64.parameters()])
    model = copy.deepcopy(model_bf16)
    model.zero_grad(set_to_none=True)
    if method == "gradaccum":
        accumulator = GradientAccumulator(model, len(batches))
        for batch in batches:
            accumulator.backward(model(**batch).loss, num_items=len(batch["labels"]))
        accumulator.finish_window()
        accumulator.remove_hooks()
    else:
        for batch in batches:
            (model(**batch).loss / len(batches)).backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return float((grad - reference).norm() / reference.norm())


def time_bf16(args) -> dict:
    g = torch.Generator().manual_seed(1)

    def batches():
        return [
            {
                "input_ids": torch.randint(1000, 30522, (4, 64), generator=g),
                "labels": torch.randint(0, 2, (4,), generator=g),
            }
            for _ in range(8)
        ]

    base = bf16_model(args.bert_hidden, args.bert_layers)
    models = {m: copy.deepcopy(base).to(torch.bfloat16) for m in ("stock", "gradaccum")}
    optimizers = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in models}
    accumulator = GradientAccumulator(models["gradaccum"], 8)
    times: dict[str, list[float]] = {m: [] for m in models}
    for rep in range(args.bf16_repeats + 1):
        order = ("stock", "gradaccum") if rep % 2 == 0 else ("gradaccum", "stock")
        window = batches()
        for method in order:
            start = time.perf_counter()
            bf16_window(method, models[method], optimizers[method], accumulator, window)
            if rep > 0:
                times[method].append(time.perf_counter() - start)
    accumulator.remove_hooks()

    check = batches()
    model64 = copy.deepcopy(base).double()
    errors = {m: gradient_error(model64, base.to(torch.bfloat16), check, m) for m in ("stock", "gradaccum")}
    stock, ours = statistics.median(times["stock"]), statistics.median(times["gradaccum"])
    return {
        "params": sum(p.numel() for p in base.parameters()),
        "stock_s_per_step": stock,
        "gradaccum_s_per_step": ours,
        "time_ratio": ours / stock,
        "per_run_s": times,
        "grad_error_vs_fp64": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200, help="Windows in the fp16 overflow run.")
    parser.add_argument("--steps", type=int, default=8, help="Micro-batches per window.")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--outlier_every", type=int, default=53, help="Inject an outlier every k-th micro-batch.")
    parser.add_argument("--growth_interval", type=int, default=20, help="Loss scaler growth interval (windows).")
    parser.add_argument("--bert_hidden", type=int, default=256)
    parser.add_argument("--bert_layers", type=int, default=4)
    parser.add_argument("--bf16_repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    stream = overflow_stream(args.windows, args.steps, args.micro, args.outlier_every, seed=0)
    overflow_rows = [run_policy(policy, stream, args.steps, args) for policy in ("skip", "recompute")]
    bf16 = time_bf16(args)

    command = "python benchmarks/bench_mixed_precision.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items())
    lines = [
        "# Mixed precision under accumulation",
        "",
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} threads.",
        "",
        f"## fp16 overflows: wasted micro-batches ({args.windows} windows x {args.steps} micro-batches of "
        f"{args.micro}; CPU autocast fp16; scale 2**16 at start, growth interval {args.growth_interval}; an outlier "
        f"every {args.outlier_every} micro-batches)",
        "",
        "| policy | overflow events | applied / skipped steps | recomputed micro-batches | forward+backward passes "
        "| wasted micro-batches | wasted per overflow | samples never in an update |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in overflow_rows:
        lines.append(
            f"| {r['policy']} | {r['overflow_events']} | {r['applied_steps']} / {r['skipped_steps']} "
            f"| {r['recomputed_micro_batches']} | {r['forward_backward_passes']} | {r['wasted_micro_batches']} "
            f"| {r['wasted_per_overflow']:.2f} | {r['samples_never_in_an_update']} |"
        )
    lines += [
        "",
        f"## bf16 parameters: fp32 buffers vs stock accumulation in the bf16 `.grad` (BERT hidden "
        f"{args.bert_hidden} x {args.bert_layers} layers, {bf16['params'] / 1e6:.1f}M params, 8 x 4 x 64 tokens, "
        f"AdamW; medians of {args.bf16_repeats} windows, ABBA)",
        "",
        "| accumulation | s / optimizer step | time ratio | gradient error vs fp64 (one window) |",
        "|---|---|---|---|",
        f"| stock (bf16 `.grad`) | {bf16['stock_s_per_step']:.3f} | 1.000 | {bf16['grad_error_vs_fp64']['stock']:.2e} |",
        f"| GradientAccumulator (fp32 buffer) | {bf16['gradaccum_s_per_step']:.3f} | {bf16['time_ratio']:.3f} "
        f"| {bf16['grad_error_vs_fp64']['gradaccum']:.2e} |",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "mixed_precision.md").write_text(text)
    payload = {"command": command, "overflow": overflow_rows, "bf16": bf16, "torch": torch.__version__}
    (RESULTS_DIR / "mixed_precision.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
