"""Where `GradAccumTrainer` spends time that the stock `Trainer` does not: one accumulation window of each under
`torch.profiler` (CPU), operator by operator, plus a `cProfile` of the same window for the Python side.

The model and data are those of `bench_trainer_overhead.py` (a MiniLM-shaped BERT classifier, random init, sequence
128, micro-batch 8 x 8 accumulation steps, AdamW, 2 threads). Each trainer runs in its own process: one warm-up
window, then windows 2..(1 + `--windows`) profiled. The table lists, per operator, the self CPU time per window of
each trainer and the difference, sorted by the difference; the rows together explain the gap between the two totals.

Command (from the repository root, with the project's virtualenv; about 2 minutes on an idle 2-core machine):

    python benchmarks/profile_trainer_window.py --windows 2

Writes `benchmarks/results/trainer_profile_{shape}.json` and `.md` (and prints the Markdown). `--shape tiny` (hidden 64,
2 layers, vocabulary 1000) shows the per-micro-batch Python work that a large model hides; `--shape resnet18` is
`bench_throughput.py`'s ResNet-18 image classifier (11.2M parameters, `--image_size` pixels, default 64), where
gradient-wide passes weigh most against the compute.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import FULL_SHAPES, build_data, build_model  # noqa: E402
from bench_trainer_overhead import NUM_THREADS  # noqa: E402

RESULT_PREFIX = "PROFILE_RESULT "
RESULTS_DIR = Path(__file__).resolve().parent / "results"
TRAINERS = ("stock", "gradaccum")


# (hidden, layers, heads, intermediate, vocab): the MiniLM shape, and a tiny one where per-micro-batch Python work shows.
SHAPES = {"minilm": (384, 6, 12, 1536, 30522), "tiny": (64, 2, 4, 256, 1000), "resnet18": FULL_SHAPES["resnet18"][:5]}


def _resnet18_model_and_rows(rows: int, image_size: int, seed: int) -> tuple[object, list[dict]]:
    """bench_throughput.py's ResNet-18 and `rows` random images (its `build_model` / `build_data`)."""
    hidden, layers, heads, intermediate, classes = SHAPES["resnet18"]
    spec = {"model": "resnet18", "hidden": hidden, "layers": layers, "heads": heads, "intermediate": intermediate}
    spec |= {"vocab": classes, "seq_len": image_size, "seed": seed, "device": "cpu", "steps": rows}
    spec |= {"micro_batch": 1, "ga": 1}
    return build_model(spec), build_data(spec)


def run_worker(
    kind: str, shape: str, windows: int, seq_len: int, micro: int, accum: int, seed: int, image_size: int = 64
) -> dict:
    rows = (windows + 1) * micro * accum
    if shape == "resnet18":
        model, dataset = _resnet18_model_and_rows(rows, image_size, seed)
    else:
        model, dataset = _bert_model_and_rows(rows, seq_len, SHAPES[shape], seed)
    return _profile(kind, model, dataset, windows, micro, accum, seed)


def _bert_model_and_rows(rows: int, seq_len: int, shape: tuple, seed: int) -> tuple[object, object]:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    rng = np.random.default_rng(seed)
    hidden, layers, heads, intermediate, vocab = shape
    input_ids = rng.integers(5, vocab, size=(rows, seq_len), dtype=np.int64)
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
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=intermediate,
            num_labels=2,
        )
    )
    return model, dataset


def _profile(kind: str, model: object, dataset: object, windows: int, micro: int, accum: int, seed: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    torch.set_num_threads(NUM_THREADS)
    hf_logging.set_verbosity_error()
    args_cls, trainer_cls = (
        (GradAccumArguments, GradAccumTrainer) if kind == "gradaccum" else (TrainingArguments, Trainer)
    )
    # A speed profile: BatchNorm heads (ResNet-18) keep the stock Trainer's per-micro-batch statistics, named.
    named = {"batchnorm_statistics": "micro_batch"} if kind == "gradaccum" else {}
    args = args_cls(
        **named,
        output_dir=f"/tmp/profile_trainer_window_{kind}",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        max_steps=windows + 1,
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )

    class Profiled(TrainerCallback):
        """Profiles from the end of the warm-up window to the end of the last one."""

        def __init__(self) -> None:
            self.torch_profile = profile(activities=[ProfilerActivity.CPU])
            self.python_profile = cProfile.Profile()
            self.wall = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.wall = time.perf_counter()
                self.torch_profile.__enter__()
                self.python_profile.enable()
            elif state.global_step == windows + 1:
                self.python_profile.disable()
                self.torch_profile.__exit__(None, None, None)
                self.wall = time.perf_counter() - self.wall

    profiled = Profiled()
    trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=[profiled]).train()

    ops: dict[str, dict[str, float]] = {}
    for event in profiled.torch_profile.key_averages():
        ops[event.key] = {"self_cpu_ms": event.self_cpu_time_total / 1e3 / windows, "calls": event.count / windows}
    stats = pstats.Stats(profiled.python_profile)
    python: dict[str, dict[str, float]] = {}
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({name})"
        python[where] = {
            "tottime_ms": tottime * 1e3 / windows,
            "cumtime_ms": cumtime * 1e3 / windows,
            "calls": ncalls / windows,
        }
    return {"trainer": kind, "wall_ms_per_window": profiled.wall * 1e3 / windows, "ops": ops, "python": python}


def _launch(kind: str, options: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--windows", str(options.windows)]
    cmd += ["--seq_len", str(options.seq_len), "--shape", options.shape, "--micro_batch", str(options.micro_batch)]
    cmd += ["--image_size", str(options.image_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"worker {kind} failed:\n{proc.stderr[-3000:]}")


def _table(stock: dict, ours: dict, key: str, field: str, top: int) -> list[str]:
    names = set(stock[key]) | set(ours[key])

    def value(side: dict, name: str) -> float:
        return side[key].get(name, {}).get(field, 0.0)

    rows = sorted(names, key=lambda n: value(ours, n) - value(stock, n), reverse=True)
    lines = [
        f"| {key} | stock ms/window | ours ms/window | ours - stock | calls stock / ours |",
        "|---|---:|---:|---:|---|",
    ]
    for name in rows[:top] + rows[-max(3, top // 4) :]:
        calls = f"{stock[key].get(name, {}).get('calls', 0):g} / {ours[key].get(name, {}).get('calls', 0):g}"
        delta = value(ours, name) - value(stock, name)
        lines.append(f"| `{name}` | {value(stock, name):.1f} | {value(ours, name):.1f} | {delta:+.1f} | {calls} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=2, help="profiled windows per trainer (after one warm-up)")
    parser.add_argument("--seq_len", type=int, default=128, help="sequence length")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="minilm", help="model shape")
    parser.add_argument("--micro_batch", type=int, default=8, help="micro-batch (8 accumulation steps)")
    parser.add_argument("--image_size", type=int, default=64, help="image side of --shape resnet18")
    parser.add_argument("--out", default=None, help="JSON path (.md beside); default results/trainer_profile_{shape}")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        result = run_worker(
            options.worker,
            options.shape,
            options.windows,
            options.seq_len,
            micro=options.micro_batch,
            accum=8,
            seed=0,
            image_size=options.image_size,
        )
        print(RESULT_PREFIX + json.dumps(result))
        return
    stock, ours = (_launch(kind, options) for kind in TRAINERS)
    total = {side["trainer"]: sum(op["self_cpu_ms"] for op in side["ops"].values()) for side in (stock, ours)}
    lines = [
        f"Wall per window: stock {stock['wall_ms_per_window']:.0f} ms, ours {ours['wall_ms_per_window']:.0f} ms "
        f"(ratio {ours['wall_ms_per_window'] / stock['wall_ms_per_window']:.3f}); operator self CPU per window: stock "
        f"{total['stock']:.0f} ms, ours {total['gradaccum']:.0f} ms.",
        "",
        *_table(stock, ours, "ops", "self_cpu_ms", options.top),
        "",
        *_table(stock, ours, "python", "tottime_ms", options.top),
    ]
    out = Path(options.out) if options.out else RESULTS_DIR / f"trainer_profile_{options.shape}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/profile_trainer_window.py " + " ".join(sys.argv[1:])
    lines = [f"Command: `{command}`", "", *lines]
    out.write_text(json.dumps({"command": command, "stock": stock, "gradaccum": ours}))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
