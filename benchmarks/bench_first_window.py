"""What measuring a model's loss normalisation costs: the first window's time against a plain window's.

`GradAccumTrainer` measures, on the first window, what the model's loss divides by (three forwards per micro-batch
without a backward, plus a forward and backward of the first micro-batch and of its two parts; docs/model_losses.md).
This runs a few windows per shape and prints the first window's wall time over the median of the later ones, with
the measurement's own seconds from `accumulation_check.json`. Each shape runs in its own process.

    python benchmarks/bench_first_window.py --out benchmarks/results/first_window.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = ("bert-seq-cls", "llama-causal-lm", "wav2vec2-ctc")


def _model_and_rows(shape: str, rows: int):
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        Wav2Vec2Config,  # fmt: skip
        Wav2Vec2ForCTC,
    )

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    size = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)
    if shape == "wav2vec2-ctc":
        model = Wav2Vec2ForCTC(Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128, ctc_loss_reduction="mean", final_dropout=0.0))  # fmt: skip
        data = []
        for _ in range(rows):
            labels = torch.full((16,), -100)
            length = int(torch.randint(4, 16, (1,), generator=g))
            labels[:length] = torch.randint(1, 32, (length,), generator=g)
            data.append({"input_values": torch.randn(16000, generator=g), "labels": labels})
        return model, data
    seq = 128
    if shape == "bert-seq-cls":
        model = BertForSequenceClassification(BertConfig(vocab_size=1000, num_labels=3, **size))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, num_key_value_heads=2, **size))
    data = []
    for _ in range(rows):
        ids = torch.randint(1, 1000, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[int(torch.randint(seq // 2, seq + 1, (1,), generator=g)) :] = 0
        labels = torch.randint(0, 3, (), generator=g) if shape == "bert-seq-cls" else ids.masked_fill(mask == 0, -100)
        data.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return model, data


def run_shape(shape: str, micro: int, steps: int, windows: int, named: str | None = None) -> dict:
    """Train `windows` windows of `steps` micro-batches of `micro` rows; time each window (wall clock)."""
    import torch
    from transformers import TrainerCallback

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, data = _model_and_rows(shape, micro * steps * windows)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = GradAccumArguments(out, per_device_train_batch_size=micro, gradient_accumulation_steps=steps,
                                  max_steps=windows, use_cpu=True, report_to=[], save_strategy="no",
                                  logging_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                                  loss_normalisation=named or "auto")  # fmt: skip
        trainer = GradAccumTrainer(model=model, args=args, train_dataset=data, callbacks=[Stamp()])
        trainer.train()
        with open(os.path.join(out, "accumulation_check.json")) as f:
            finding = json.load(f)["loss_normalisation"]
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    plain = statistics.median(times[1:])
    return {
        "shape": shape, "micro_batch": micro, "gradient_accumulation_steps": steps, "rule": finding["rule"],
        "first_window_s": times[0], "plain_window_median_s": plain, "ratio": times[0] / plain,
        "measurement_s": finding.get("seconds"), "forwards": finding.get("forwards"), "named": named,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--out", default=None, help="JSON file for the rows (printed either way).")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--named", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        steps = args.gradient_accumulation_steps
        print(json.dumps(run_shape(args.worker, args.micro_batch, steps, args.windows, args.named)))
        return
    rows = []
    for shape in args.shapes:
        # Each run in a fresh process: measured (the default), then the rule it found named, which measures nothing;
        # the difference of their first windows is the measurement's cost, in plain windows.
        pair = []
        for named in (False, True):
            cmd = [sys.executable, __file__, "--worker", shape, "--micro_batch", str(args.micro_batch),
                   "--gradient_accumulation_steps", str(args.gradient_accumulation_steps), "--windows",
                   str(args.windows)]  # fmt: skip
            if named:
                cmd += ["--named", pair[0]["rule"]]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            pair.append(json.loads(out))
        measured, named_run = pair
        row = {**measured, "first_window_named_s": named_run["first_window_s"],
               "plain_window_named_median_s": named_run["plain_window_median_s"]}  # fmt: skip
        row["measurement_cost_windows"] = (row["first_window_s"] - row["first_window_named_s"]) / row[
            "plain_window_median_s"
        ]
        rows.append(row)
        print(f"{shape:16s} rule {row['rule']:22s} first window {row['first_window_s']:.2f} s (named rule: "
              f"{row['first_window_named_s']:.2f} s), plain window {row['plain_window_median_s']:.2f} s: first/plain "
              f"{row['ratio']:.2f}, measurement {row['measurement_cost_windows']:.2f} plain windows "
              f"({row['measurement_s']:.2f} s, {row['forwards']} forwards)", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
