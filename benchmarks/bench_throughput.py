"""Throughput and peak memory of `GradAccumTrainer` against the stock `transformers.Trainer` and a bare Accelerate loop.

Four runners train the same random-init model on the same synthetic data:

* `stock`: `transformers.Trainer`.
* `gradaccum`: `GradAccumTrainer` (same `TrainingArguments` fields, through `GradAccumArguments`).
* `accelerate_loop`: the standard Accelerate accumulation loop, `Accelerator(gradient_accumulation_steps=GA,
  mixed_precision=...)`; per micro-batch `with accelerator.accumulate(model): loss = model(**batch).loss;
  accelerator.backward(loss)`, `accelerator.clip_grad_norm_` when `accelerator.sync_gradients`, then
  `optimizer.step(); optimizer.zero_grad()`.
* `gradaccum_loop`: `GradientAccumulator` in the same Accelerate loop, as in `recipes/plain_accelerate_loop.py`
  (`with accumulator.accumulate(model)`, `accumulator.backward(loss, batch=batch)`, `accumulator.step(optimizer,
  max_grad_norm=1.0)` when `accumulator.sync_gradients`). Under fp16 it owns the loss scaling (`DynamicLossScaler`,
  `accumulate_micro_batch` so an overflow recomputes one micro-batch), so its optimizer is not passed through
  `accelerator.prepare`: the Accelerator's GradScaler would unscale gradients the accumulator already unscaled.

The grid: models `bert-base` (`BertForSequenceClassification`, hidden 768, 12 layers, 12 heads, intermediate 3072,
vocab 30522, 2 labels, sequence length 128, micro-batch 16) and `gpt2-small` (`GPT2LMHeadModel`, n_embd 768, 12
layers, 12 heads, vocab 50257, sequence length 256, micro-batch 8, uneven padding: each row holds a random length in
[seq/2, seq], the rest is padding with `attention_mask` 0 and `labels` -100), precisions fp32 / bf16 / fp16 (Trainer
`bf16=True` / `fp16=True`, Accelerate `mixed_precision`; fp32 weights throughout; TF32 left at torch's default and
recorded), gradient accumulation 1 and 8, the four runners: 2 x 3 x 2 x 4 = 48 configurations. Two more shapes for
the CPU (`--models minilm,gpt2-small,resnet18`): `minilm`, the MiniLM-shaped classifier of
`bench_trainer_overhead.py` (hidden 384, 6 layers, intermediate 1536, sequence 128, micro-batch 8), and `resnet18`
(`ResNetForImageClassification`, basic blocks 2-2-2-2, widths 64-512, 10 classes, random 224 x 224 images,
micro-batch 16; `--image_size` to shrink them). `--micro_batch` and `--seq_len` override every model's. Random token
ids and random init from a fixed seed, no `datasets` (a list of dicts of tensors), no network. AdamW
(`optim="adamw_torch"` in the Trainer, `torch.optim.AdamW` in the loops), lr 1e-5, weight decay 0, constant
schedule, `max_grad_norm=1.0` everywhere, no eval, no saving, no logging, `dataloader_num_workers=0`.

Steadier ratios: `--rounds N` runs the grid N times, the two runners of each pair (stock / ours, Accelerate loop /
ours) in alternating order from round to round, and reports each ratio as the median of the N per-round ratios with
their range; `--metric cpu` measures speed in samples per second of the worker's process CPU time (all threads) over
the timed steps, which other processes on a shared CPU disturb less than wall time.

How: every configuration runs in its own subprocess (this script re-invoked with `--worker JSON`, which prints one
`BENCH_RESULT {json}` line), with a per-worker timeout (`--timeout`, 90 s): a crashed or hung worker is recorded with
its last error line and the others go on. Each worker trains `--steps` optimizer steps (default 4): the first is
warmup, the rest are timed from the end of the warmup step to the end of the last step (Trainer: `on_step_end`;
loops: after the optimizer step), with `torch.cuda.synchronize()` before each clock read. samples/s = samples of the
timed steps / seconds. Peak memory: `torch.cuda.max_memory_allocated()` (and `max_memory_reserved()`) after
`torch.cuda.reset_peak_memory_stats()` at the start of training (Trainer: `on_train_begin`; loops: before the
accumulator is built and the first batch), so it includes the AdamW state; on CPU the worker's peak RSS
(`ru_maxrss`). One run per configuration and 3 timed steps: on a GPU a ratio moves by a few percent between runs.

Goals (from the product issue), per (model, precision, GA): samples/s of `gradaccum` >= 0.97 x `stock`; of
`gradaccum_loop` >= 0.95 x `accelerate_loop`; peak allocated memory of `gradaccum` <= `stock` in fp32 and bf16.

Results: `--out PATH.json` (every worker's result and the machine), `PATH.md` (the table, also printed) and, when
matplotlib imports, `PATH.png` (the speed ratios). On CPU, `--device cpu --tiny` runs the same grid with tiny shapes
(2 layers, hidden 64, vocab 1000, sequence 32, micro-batch 4, 2 steps); fp16 is skipped there for the runners whose
Accelerator does not autocast fp16 on CPU (they would silently train in fp32), with the reason recorded; each CPU
worker uses `--cpu_threads` (1) torch threads, since more OpenMP threads than free cores stall on a shared machine.

Command (from the repository root). One worker took 14 to 22 s of wall time on the H100 machine this was first run
on (torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0): imports 5 to 7 s, then CUDA context, data and
model another 6 to 10 s, Trainer/Accelerator construction and exit about 3 s; training itself 1 to 2.5 s. So the
whole grid (48 workers) takes about 14 minutes there, not the 4 minutes hoped for; `cuda_init_s`, `data_s`,
`model_s`, `setup_s` and `process_wall_s` in the JSON say where the start-up goes. Split it over calls with
`--resume` (configurations already in `--out` are kept and not run again):

    python benchmarks/bench_throughput.py --models bert-base --out benchmarks/results/throughput.json
    python benchmarks/bench_throughput.py --models gpt2-small --out benchmarks/results/throughput.json --resume
    python benchmarks/bench_throughput.py --device cpu --tiny --models bert-base --precisions fp32 --ga 2 \\
        --out /tmp/throughput_cpu.json   # the CPU smoke run of tests/test_bench_throughput.py (about 20 s)
    python benchmarks/bench_throughput.py --device cpu --models minilm,gpt2-small,resnet18 --precisions fp32 \\
        --ga 8 --micro_batch 4 --seq_len 128 --image_size 64 --steps 3 --rounds 5 --metric cpu --cpu_threads 2 \\
        --timeout 600 --out benchmarks/results/overhead_shapes_cpu.json   # the three CPU shapes, 5 pairs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH_RESULT "
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

MODELS = ("bert-base", "gpt2-small", "minilm", "resnet18")
PRECISIONS = ("fp32", "bf16", "fp16")
RUNNERS = ("stock", "gradaccum", "accelerate_loop", "gradaccum_loop")
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

# model -> (hidden, layers, heads, intermediate, vocab, seq_len, default micro-batch)
FULL_SHAPES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "bert-base": (768, 12, 12, 3072, 30522, 128, 16),
    "gpt2-small": (768, 12, 12, 3072, 50257, 256, 8),
    # The MiniLM-shaped classifier of bench_trainer_overhead.py (the CPU shape).
    "minilm": (384, 6, 12, 1536, 30522, 128, 8),
    # ResNet-18 (basic blocks, depths 2-2-2-2, widths 64-512): (stem width, -, -, -, classes, image side, micro).
    "resnet18": (64, 4, 0, 0, 10, 224, 16),
}
SEQUENCE_MODELS = ("bert-base", "gpt2-small", "minilm")
BERT_LIKE = ("bert-base", "minilm")
TINY_SHAPE = (64, 2, 4, 256, 1000, 32, 4)
TINY_RESNET_SHAPE = (8, 2, 0, 0, 10, 32, 4)
TINY_STEPS = 2

SPEED_VS_STOCK_GOAL = 0.97
SPEED_VS_LOOP_GOAL = 0.95
MEMORY_VS_STOCK_GOAL = 1.0
MEMORY_GOAL_PRECISIONS = ("fp32", "bf16")


class SkipConfiguration(Exception):
    """This configuration cannot be measured honestly here (e.g. fp16 without autocast on CPU)."""


# ---------------------------------------------------------------------------------------------------- worker
def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _Meter:
    """Clock and memory readings at the start of training and at the end of each optimizer step."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        self.step_ends: list[float] = []
        # Process CPU time (all threads) at each step end: on a shared CPU it moves less than wall time when other
        # processes take cores away (the worker waits instead of computing).
        self.step_cpu_ends: list[float] = []
        # Minor page faults at each step end: memory the kernel maps and zeroes on first touch, which glibc's malloc
        # causes again and again when it hands freed memory back (see `--allocator`).
        self.step_page_faults: list[int] = []
        self.train_begin = 0.0
        self.allocated_at_begin = 0
        self.rss_at_begin_kib = 0

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def begin(self) -> None:
        self._sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            self.allocated_at_begin = self.torch.cuda.memory_allocated()
        self.rss_at_begin_kib = _rss_kib()
        self.train_begin = time.perf_counter()

    def step_end(self) -> None:
        self._sync()
        self.step_ends.append(time.perf_counter())
        self.step_cpu_ends.append(time.process_time())
        self.step_page_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def memory(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_at_train_begin_mib": self.rss_at_begin_kib / 1024,
        }
        if self.cuda:
            mib = 1024 * 1024
            out.update(
                peak_allocated_mib=self.torch.cuda.max_memory_allocated() / mib,
                peak_reserved_mib=self.torch.cuda.max_memory_reserved() / mib,
                allocated_at_train_begin_mib=self.allocated_at_begin / mib,
            )
            out["peak_mib"] = out["peak_allocated_mib"]
        else:
            out["peak_mib"] = out["peak_rss_mib"]
        return out


def build_data(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows for `steps` full windows: random token ids from a fixed seed, as a list of dicts of tensors."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    rows, seq, vocab = spec["steps"] * spec["micro_batch"] * spec["ga"], spec["seq_len"], spec["vocab"]
    data: list[dict[str, Any]] = []
    if spec["model"] == "resnet18":
        side = spec["seq_len"]
        pixels = torch.randn(rows, 3, side, side, generator=g)
        labels = torch.randint(0, vocab, (rows,), generator=g)
        return [{"pixel_values": pixels[i], "labels": labels[i]} for i in range(rows)]
    if spec["model"] in BERT_LIKE:
        ids = torch.randint(5, vocab, (rows, seq), generator=g)
        labels = torch.randint(0, 2, (rows,), generator=g)
        for i in range(rows):
            data.append(
                {"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels[i]}
            )
    else:
        ids = torch.randint(0, vocab - 1, (rows, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
        positions = torch.arange(seq)
        for i in range(rows):
            mask = (positions < lengths[i]).long()
            row_ids = ids[i].masked_fill(mask == 0, vocab - 1)  # pad with the last id (GPT-2's <|endoftext|>)
            data.append({"input_ids": row_ids, "attention_mask": mask, "labels": row_ids.masked_fill(mask == 0, -100)})
    return data


def build_model(spec: dict[str, Any]) -> Any:
    import torch

    hidden, layers, heads, intermediate = spec["hidden"], spec["layers"], spec["heads"], spec["intermediate"]
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):  # random init directly on the device (faster than on the CPU, then moved)
        if spec["model"] == "resnet18":
            from transformers import ResNetConfig, ResNetForImageClassification

            widths = [hidden * 2**i for i in range(layers)]
            config = ResNetConfig(
                embedding_size=hidden,
                hidden_sizes=widths,
                depths=[2] * layers,
                layer_type="basic",
                num_labels=spec["vocab"],
            )
            return ResNetForImageClassification(config)
        if spec["model"] in BERT_LIKE:
            from transformers import BertConfig, BertForSequenceClassification

            config = BertConfig(
                vocab_size=spec["vocab"],
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=intermediate,
                max_position_embeddings=max(512, spec["seq_len"]),
                num_labels=2,
            )
            return BertForSequenceClassification(config)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=spec["vocab"],
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=intermediate,
            n_positions=max(1024, spec["seq_len"]),
            pad_token_id=spec["vocab"] - 1,
        )
        return GPT2LMHeadModel(config)


def _make_loader(data: list[dict[str, Any]], spec: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        data,
        batch_size=spec["micro_batch"],
        shuffle=True,
        generator=torch.Generator().manual_seed(spec["seed"]),
        num_workers=0,
        pin_memory=spec["device"] == "cuda",
    )


def _skip_fp16_without_autocast(accelerator: Any, spec: dict[str, Any]) -> None:
    if spec["precision"] == "fp16" and not accelerator.native_amp:
        raise SkipConfiguration(
            f"Accelerate does not autocast fp16 on {spec['device']} (native_amp=False): it would train in fp32"
        )


def trainer_arguments(spec: dict[str, Any]) -> Any:
    """The `TrainingArguments` of a Trainer runner (`GradAccumArguments` for `gradaccum`): the same fields for both."""
    from transformers import TrainingArguments

    from hf_gradaccum import GradAccumArguments

    gradaccum = spec["runner"] == "gradaccum"
    # A speed comparison: BatchNorm heads (ResNet) keep the stock Trainer's per-micro-batch statistics, named.
    path = (
        {"accumulation_path": spec.get("accumulation_path", "auto"), "batchnorm_statistics": "micro_batch"}
        if gradaccum
        else {}
    )
    return (GradAccumArguments if gradaccum else TrainingArguments)(
        **path,
        output_dir=tempfile.mkdtemp(prefix="bench_throughput_"),
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["ga"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        weight_decay=0.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        max_grad_norm=1.0,
        bf16=spec["precision"] == "bf16",
        fp16=spec["precision"] == "fp16",
        use_cpu=spec["device"] == "cpu",
        seed=spec["seed"],
        data_seed=spec["seed"],
        dataloader_num_workers=0,
        dataloader_pin_memory=spec["device"] == "cuda",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )


def run_trainer(spec: dict[str, Any], model: Any, data: list[dict[str, Any]], meter: _Meter) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    from hf_gradaccum import GradAccumTrainer

    gradaccum = spec["runner"] == "gradaccum"
    trainer_cls = GradAccumTrainer if gradaccum else Trainer
    args = trainer_arguments(spec)

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.step_end()

    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[Clock()])
    # The GradAccumTrainer autocasts fp16 itself where Accelerate does not (CPU); the stock Trainer would not.
    if not gradaccum:
        _skip_fp16_without_autocast(trainer.accelerator, spec)
    trainer.train()
    extra: dict[str, Any] = {"optimizer_steps": trainer.state.global_step}
    acc = getattr(trainer, "accumulator", None)
    if acc is not None:
        extra["accumulator"] = {
            "applied_steps": acc.applied_steps,
            "skipped_steps": dict(acc.skipped_steps),
            "recomputed_micro_batches": acc.recomputed_micro_batches,
        }
    return extra


def run_accelerate_loop(spec: dict[str, Any], model: Any, data: list[dict[str, Any]], meter: _Meter) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=spec["ga"],
        mixed_precision=MIXED_PRECISION[spec["precision"]],
        cpu=spec["device"] == "cpu",
    )
    _skip_fp16_without_autocast(accelerator, spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _make_loader(data, spec))
    model.train()
    meter.begin()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            meter.step_end()
    return {"optimizer_steps": len(meter.step_ends)}


def run_gradaccum_loop(spec: dict[str, Any], model: Any, data: list[dict[str, Any]], meter: _Meter) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    from hf_gradaccum import DynamicLossScaler, GradientAccumulator

    fp16 = spec["precision"] == "fp16"
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[spec["precision"]], cpu=spec["device"] == "cpu")
    _skip_fp16_without_autocast(accelerator, spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    if fp16:  # the accumulator scales the loss; Accelerate's GradScaler must not unscale the gradients again
        model, loader = accelerator.prepare(model, _make_loader(data, spec))
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, _make_loader(data, spec))
    model.train()
    meter.begin()
    accumulator = GradientAccumulator(
        model,
        gradient_accumulation_steps=spec["ga"],
        loss_scaler=DynamicLossScaler() if fp16 else None,
        accumulation_path=spec.get("accumulation_path", "auto"),
        batchnorm_statistics="micro_batch",  # a speed comparison: the stock loop's per-micro-batch statistics
    )
    for batch in loader:
        with accumulator.accumulate(model):
            if fp16:  # an overflowing micro-batch is recomputed at the backed-off scale
                accumulator.accumulate_micro_batch(lambda batch=batch: model(**batch).loss, batch=batch)
            else:
                loss = model(**batch).loss
                accumulator.backward(loss, batch=batch)
        if accumulator.sync_gradients:
            accumulator.step(optimizer, max_grad_norm=1.0)
            meter.step_end()
    accumulator.flush(optimizer, max_grad_norm=1.0)  # a no-op: the data is whole windows
    return {
        "optimizer_steps": len(meter.step_ends),
        "accumulator": {
            "applied_steps": accumulator.applied_steps,
            "skipped_steps": dict(accumulator.skipped_steps),
            "recomputed_micro_batches": accumulator.recomputed_micro_batches,
        },
    }


RUNNER_FUNCTIONS = {
    "stock": run_trainer,
    "gradaccum": run_trainer,
    "accelerate_loop": run_accelerate_loop,
    "gradaccum_loop": run_gradaccum_loop,
}


@contextlib.contextmanager
def _cuda_sync_trace(enabled: bool) -> Iterator[list[dict[str, Any]] | None]:
    """Count every host synchronisation CUDA reports during training, grouped by the Python stack that caused it.

    A sync inside the accumulation window stalls the host until the GPU drains, so the next micro-batch's kernels
    are not queued in time; on a CPU they cost nothing, which is why only a GPU run can find them.
    """
    if not enabled:
        yield None
        return
    import torch

    counts: collections.Counter[str] = collections.Counter()
    points: list[dict[str, Any]] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        counts["\n".join(f"{f.filename}:{f.lineno} {f.name}" for f in frames[-8:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield points
        finally:
            torch.cuda.set_sync_debug_mode("default")
    points.extend({"count": n, "stack": stack} for stack, n in counts.most_common(12))


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model and data of `spec`, train `spec["steps"]` optimizer steps with its runner, measure."""
    t0 = time.perf_counter()
    import accelerate
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t_imports = time.perf_counter() - t0
    cuda = spec["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if not cuda:
        torch.set_num_threads(spec["cpu_threads"])
    t1 = time.perf_counter()
    if cuda:  # the CUDA context, timed on its own: start-up is most of a worker's wall time
        torch.ones(1, device="cuda").sum().item()
    t_cuda_init = time.perf_counter() - t1
    result: dict[str, Any] = {
        "spec": spec,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_threads": torch.get_num_threads(),
        "import_s": t_imports,
        "cuda_init_s": t_cuda_init,
    }
    t1 = time.perf_counter()
    data = build_data(spec)
    t2 = time.perf_counter()
    model = build_model(spec)
    result["data_s"], result["model_s"] = t2 - t1, time.perf_counter() - t2
    result["num_params"] = sum(p.numel() for p in model.parameters())
    result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    result["setup_s"] = time.perf_counter() - t0
    meter = _Meter(spec["device"])
    try:
        with _cuda_sync_trace(spec.get("cuda_sync_trace", False)) as sync_points:
            result.update(RUNNER_FUNCTIONS[spec["runner"]](spec, model, data, meter))
        if sync_points is not None:
            result["cuda_sync_points"] = sync_points
    except SkipConfiguration as reason:
        return {**result, "status": "skipped", "reason": str(reason)}
    except Exception as error:
        if spec["device"] == "cpu" and spec["precision"] == "fp16":  # fp16 on CPU may not work: not a failure
            return {**result, "status": "skipped", "reason": f"fp16 on CPU: {type(error).__name__}: {error}"}
        raise
    ends = meter.step_ends
    samples_per_step = spec["micro_batch"] * spec["ga"]
    timed_steps = len(ends) - 1
    if len(ends) != spec["steps"]:
        raise RuntimeError(f"{len(ends)} optimizer steps ended, expected {spec['steps']}")
    timed_s = ends[-1] - ends[0]
    result.update(
        status="ok",
        step_times_s=[ends[0] - meter.train_begin] + [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)],
        timed_steps=timed_steps,
        timed_s=timed_s,
        samples_per_s=timed_steps * samples_per_step / timed_s if timed_steps > 0 and timed_s > 0 else None,
        cpu_timed_s=meter.step_cpu_ends[-1] - meter.step_cpu_ends[0],
        page_faults_per_step=[
            b - a for a, b in zip(meter.step_page_faults[:-1], meter.step_page_faults[1:], strict=True)
        ],
        train_s=ends[-1] - meter.train_begin,
        **meter.memory(),
    )
    return result


# ---------------------------------------------------------------------------------------------------- parent
def worker_env(spec: dict[str, Any]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}  # no leaked mixed precision
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if spec["device"] == "cpu":  # few threads: on a shared CPU, more OpenMP threads than free cores stall each step
        env.update(OMP_NUM_THREADS=str(spec["cpu_threads"]), MKL_NUM_THREADS=str(spec["cpu_threads"]))
    else:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU: the Trainer would use DataParallel over several
    env.update(allocator_env(spec.get("allocator", "default"), env))
    return env


# glibc's malloc hands freed memory back to the kernel (a free heap top above M_TRIM_THRESHOLD, any block above
# M_MMAP_THRESHOLD, both adapted at run time), so a training step's allocations are mapped and zeroed page by page
# again; how often depends on the allocation history. `glibc-retain` fixes both thresholds high (32 MiB is glibc's
# largest mmap threshold on 64-bit: larger blocks are still mapped fresh); `tcmalloc` preloads tcmalloc, which keeps
# freed memory for reuse.
GLIBC_RETAIN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(16 * 1024**3)}
ALLOCATORS = ("default", "glibc-retain", "tcmalloc")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str:
    """Path of an installed tcmalloc; a `SystemExit` naming the package when there is none."""
    for directory in TCMALLOC_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(directory) / name).exists():
                return str(Path(directory) / name)
    raise SystemExit(
        "--allocator tcmalloc: no tcmalloc library in " + ", ".join(TCMALLOC_DIRS) + " (Debian/Ubuntu: "
        "`apt-get install libtcmalloc-minimal4`)"
    )


def allocator_env(allocator: str, env: dict[str, str]) -> dict[str, str]:
    """Environment variables that start a process with `allocator` (one of `ALLOCATORS`)."""
    if allocator == "glibc-retain":
        return dict(GLIBC_RETAIN_ENV)
    if allocator == "tcmalloc":
        return {"LD_PRELOAD": " ".join(filter(None, [find_tcmalloc(), env.get("LD_PRELOAD")]))}
    return {}


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or line.startswith("RuntimeError"):
            return line[:500]
    return lines[-1][:500] if lines else "(no output)"


def launch(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=worker_env(spec), timeout=timeout_s, cwd=REPO_ROOT
        )
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        return {
            "spec": spec,
            "status": "timeout",
            "error": f"no result after {timeout_s:.0f} s; last stderr: {_last_error_line(stderr or '')}",
            "process_wall_s": time.perf_counter() - t0,
        }
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        return {
            "spec": spec,
            "status": "failed",
            "returncode": proc.returncode,
            "error": _last_error_line(proc.stderr + "\n" + proc.stdout),
            "stderr_tail": proc.stderr[-4000:],
            "process_wall_s": wall,
        }
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_wall_s"] = wall
    cpu_s = result.get("cpu_timed_s")
    samples = result["timed_steps"] * spec["micro_batch"] * spec["ga"]
    result["samples_per_cpu_s"] = samples / cpu_s if cpu_s else None
    return result


def make_spec(
    opts: argparse.Namespace, model: str, precision: str, ga: int, runner: str, round_index: int = 0
) -> dict[str, Any]:
    if opts.tiny:
        hidden, layers, heads, intermediate, vocab, seq, micro = (
            TINY_RESNET_SHAPE if model == "resnet18" else TINY_SHAPE
        )
    else:
        hidden, layers, heads, intermediate, vocab, seq, micro = FULL_SHAPES[model]
        micro = {"bert-base": opts.bert_micro_batch, "gpt2-small": opts.gpt2_micro_batch}.get(model, micro)
    seq = (opts.image_size if model == "resnet18" else opts.seq_len) or seq
    micro = opts.micro_batch or micro
    return {
        "model": model,
        "precision": precision,
        "ga": ga,
        "runner": runner,
        "device": opts.device,
        "tiny": opts.tiny,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "intermediate": intermediate,
        "vocab": vocab,
        "seq_len": seq,
        "micro_batch": micro,
        "steps": opts.steps if opts.steps is not None else (TINY_STEPS if opts.tiny else 4),
        "lr": 1e-5,
        "seed": opts.seed,
        "cpu_threads": opts.cpu_threads if opts.device == "cpu" else None,
        "accumulation_path": getattr(opts, "accumulation_path", "auto"),
        "cuda_sync_trace": getattr(opts, "cuda_sync_trace", False),
        "allocator": getattr(opts, "allocator", "default"),
        **({"round": round_index} if opts.rounds > 1 else {}),
    }


def _spec_key(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


PAIRS = {"gradaccum_vs_stock": ("gradaccum", "stock"), "loop_vs_accelerate": ("gradaccum_loop", "accelerate_loop")}


def summarize(results: list[dict[str, Any]], metric: str = "wall") -> list[dict[str, Any]]:
    """
    One row per (model, precision, GA): each runner's samples/s (median over rounds) and peak memory, the ratios, the
    goals. With several rounds each ratio is the median of the per-round ratios (a round runs the two runners of a
    pair one after the other, in alternating order), with their range. `metric="cpu"` uses samples per second of
    the worker's process CPU time instead of wall time.
    """
    speed_key = "samples_per_s" if metric == "wall" else "samples_per_cpu_s"
    groups: dict[tuple[str, str, int], dict[int, dict[str, dict[str, Any]]]] = {}
    micro: dict[tuple[str, str, int], int] = {}
    for r in results:
        s = r["spec"]
        key = (s["model"], s["precision"], s["ga"])
        groups.setdefault(key, {}).setdefault(s.get("round", 0), {})[s["runner"]] = r
        micro[key] = s["micro_batch"]
    rows: list[dict[str, Any]] = []
    for key, rounds in groups.items():
        row: dict[str, Any] = {"model": key[0], "precision": key[1], "ga": key[2], "micro_batch": micro[key]}
        row["rounds"] = len(rounds)
        for runner in RUNNERS:
            runs = [by_runner[runner] for by_runner in rounds.values() if runner in by_runner]
            ok = [run for run in runs if run.get("status") == "ok"]
            row[f"{runner}_status"] = runs[-1].get("status") if runs else None
            row[f"{runner}_samples_per_s"] = _median([run.get(speed_key) for run in ok])
            row[f"{runner}_peak_mib"] = _median([run.get("peak_mib") for run in ok])
            row[f"{runner}_peak_reserved_mib"] = _median([run.get("peak_reserved_mib") for run in ok])
        for name, (ours, theirs) in PAIRS.items():
            speed, memory = [], []
            for by_runner in rounds.values():
                a, b = by_runner.get(ours, {}), by_runner.get(theirs, {})
                if a.get("status") == "ok" and b.get("status") == "ok":
                    speed.append(_ratio(a.get(speed_key), b.get(speed_key)))
                    memory.append(_ratio(a.get("peak_mib"), b.get("peak_mib")))
            speed = [v for v in speed if v is not None]
            row[f"speed_{name}"] = _median(speed)
            row[f"speed_{name}_range"] = [min(speed), max(speed)] if speed else None
            row[f"memory_{name}"] = _median(memory)
        goals: dict[str, bool | None] = {
            "speed_vs_stock": None
            if row["speed_gradaccum_vs_stock"] is None
            else row["speed_gradaccum_vs_stock"] >= SPEED_VS_STOCK_GOAL,
            "speed_vs_loop": None
            if row["speed_loop_vs_accelerate"] is None
            else row["speed_loop_vs_accelerate"] >= SPEED_VS_LOOP_GOAL,
            "memory_vs_stock": None
            if row["precision"] not in MEMORY_GOAL_PRECISIONS or row["memory_gradaccum_vs_stock"] is None
            else row["memory_gradaccum_vs_stock"] <= MEMORY_VS_STOCK_GOAL,
        }
        row["goals"] = goals
        rows.append(row)
    order = {m: i for i, m in enumerate(MODELS)}, {p: i for i, p in enumerate(PRECISIONS)}
    return sorted(rows, key=lambda r: (order[0][r["model"]], order[1][r["precision"]], r["ga"]))


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio_cell(row: dict[str, Any], name: str) -> str:
    value, spread = row[f"speed_{name}"], row.get(f"speed_{name}_range")
    if value is None or not spread or row.get("rounds", 1) < 2:
        return _fmt(value, ".3f")
    return f"{value:.3f} ({spread[0]:.3f}-{spread[1]:.3f})"


def _mark(goal: bool | None) -> str:
    return "-" if goal is None else ("pass" if goal else "**FAIL**")


def _cell(row: dict[str, Any], runner: str, key: str, spec: str) -> str:
    value = row.get(f"{runner}_{key}")
    if value is not None:
        return format(value, spec)
    status = row.get(f"{runner}_status")
    return "not run" if status is None else status


def markdown(rows: list[dict[str, Any]], results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    mem_name = "peak allocated MiB" if meta["device"] == "cuda" else "peak RSS MiB"
    lines = [
        "# Throughput and peak memory: GradAccumTrainer vs Trainer, GradientAccumulator vs Accelerate loop",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Device: {meta['device_name']} ({meta['device']}); torch {meta['torch']}, transformers "
        f"{meta['transformers']}, accelerate {meta['accelerate']}; TF32 matmul {meta['allow_tf32_matmul']} (torch's "
        f"default, left as is); {meta['steps']} optimizer steps per run, the first warmup; "
        f"{'tiny shapes' if meta['tiny'] else 'full shapes'}; "
        + (
            f"{meta['rounds']} rounds of alternating pairs, each ratio the median of the per-round ratios (range in "
            "brackets); "
            if meta["rounds"] > 1
            else "one run per configuration; "
        )
        + f"speed from {'wall' if meta['metric'] == 'wall' else 'process CPU'} time; "
        f"whole grid {meta['total_wall_s']:.0f} s.",
        "",
        "samples/s of each runner (st = stock Trainer, ga = GradAccumTrainer, acc = Accelerate loop, gal = "
        f"GradientAccumulator loop); ratios ga/st and gal/acc for speed and {mem_name}. Goals: speed ga/st >= "
        f"{SPEED_VS_STOCK_GOAL}, gal/acc >= {SPEED_VS_LOOP_GOAL}; memory ga/st <= {MEMORY_VS_STOCK_GOAL} in fp32 and "
        "bf16.",
        "",
        "| model | prec | GA | micro | st samples/s | ga samples/s | acc samples/s | gal samples/s | speed ga/st "
        f"| speed gal/acc | st {mem_name} | ga {mem_name} | acc {mem_name} | gal {mem_name} | mem ga/st | mem gal/acc "
        "| goal speed vs stock | goal speed vs loop | goal mem vs stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        g = row["goals"]
        lines.append(
            f"| {row['model']} | {row['precision']} | {row['ga']} | {row['micro_batch']} | "
            + " | ".join(_cell(row, k, "samples_per_s", ".1f") for k in RUNNERS)
            + f" | {_ratio_cell(row, 'gradaccum_vs_stock')} | {_ratio_cell(row, 'loop_vs_accelerate')} | "
            + " | ".join(_cell(row, k, "peak_mib", ".0f") for k in RUNNERS)
            + f" | {_fmt(row['memory_gradaccum_vs_stock'], '.3f')} | {_fmt(row['memory_loop_vs_accelerate'], '.3f')}"
            + f" | {_mark(g['speed_vs_stock'])} | {_mark(g['speed_vs_loop'])} | {_mark(g['memory_vs_stock'])} |"
        )
    counts = {
        name: [row["goals"][name] for row in rows if row["goals"][name] is not None] for name in rows[0]["goals"]
    }
    lines += [
        "",
        "Goals met: "
        + "; ".join(f"{name} {sum(v)}/{len(v)}" for name, v in counts.items())
        + ". `-`: not applicable (memory goal outside fp32/bf16) or a runner has no figure.",
    ]
    problems = [r for r in results if r.get("status") != "ok"]
    if problems:
        lines += ["", "Not measured:", ""]
        for r in problems:
            s = r["spec"]
            why = r.get("reason") or r.get("error") or ""
            lines.append(f"- {s['model']} {s['precision']} GA {s['ga']} {s['runner']}: {r.get('status')}: {why}")
    lines += [
        "",
        "samples/s: samples of the timed steps / their "
        + ("wall time" if meta["metric"] == "wall" else "process CPU time (all threads)")
        + " (end of the warmup step to the end of the last step, "
        "CUDA synchronized). Peak memory: "
        + (
            "`torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()` at the start of training "
            "(`peak_reserved_mib` in the JSON has `max_memory_reserved()`)."
            if meta["device"] == "cuda"
            else "the worker process's `ru_maxrss` (imports, model and data included)."
        ),
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Bar plot of the two speed ratios per (model, precision, GA); False when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    labels = [f"{r['model']}\n{r['precision']} GA{r['ga']}" for r in rows]
    x = list(range(len(rows)))
    width = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.5))
    ratio_keys = ("speed_gradaccum_vs_stock", "speed_loop_vs_accelerate")
    for offset, key, name in (
        (-width / 2, "speed_gradaccum_vs_stock", "GradAccumTrainer / Trainer"),
        (width / 2, "speed_loop_vs_accelerate", "GradientAccumulator loop / Accelerate loop"),
    ):
        ax.bar([i + offset for i in x], [r[key] or 0.0 for r in rows], width, label=name)
    ax.axhline(SPEED_VS_STOCK_GOAL, color="C0", linestyle="--", linewidth=1)
    ax.axhline(SPEED_VS_LOOP_GOAL, color="C1", linestyle=":", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("samples/s ratio")
    ax.set_ylim(0.0, max([1.2] + [(r[k] or 0.0) * 1.1 for r in rows for k in ratio_keys]))
    ax.set_title("Throughput ratios (goals: dashed 0.97 vs stock, dotted 0.95 vs the Accelerate loop)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _csv(value: str, allowed: tuple[str, ...] | None = None, cast: type = str) -> list[Any]:
    items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    if allowed is not None:
        unknown = [v for v in items if v not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda v: _csv(v, MODELS), default=list(MODELS))
    parser.add_argument("--precisions", type=lambda v: _csv(v, PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--ga", type=lambda v: _csv(v, None, int), default=[1, 8], help="accumulation steps, e.g. 1,8")
    parser.add_argument("--runners", type=lambda v: _csv(v, RUNNERS), default=list(RUNNERS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (2 layers, hidden 64, vocab 1000, seq 32)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per worker, first warmup (4; tiny 2)")
    parser.add_argument("--bert_micro_batch", type=int, default=16)
    parser.add_argument("--gpt2_micro_batch", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per worker before it is killed")
    parser.add_argument("--cpu_threads", type=int, default=1, help="torch threads per worker with --device cpu")
    parser.add_argument(
        "--micro_batch", type=int, default=None, help="micro-batch for every model (default: per model)"
    )
    parser.add_argument(
        "--seq_len", type=int, default=None, help="sequence length of the text models (default: per model)"
    )
    parser.add_argument("--image_size", type=int, default=None, help="image side of resnet18 (default 224; tiny 32)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the grid this many times, each pair's order alternating (stock, ours / ours, stock); ratios "
        "are the median of the per-round ratios, with their range",
    )
    parser.add_argument(
        "--metric",
        choices=("wall", "cpu"),
        default="wall",
        help="speed from wall time or from the worker's process CPU time (steadier on a shared CPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--accumulation_path",
        choices=("auto", "hooks", "in_place"),
        default="auto",
        help="how GradAccumTrainer and GradientAccumulator fold micro-batches (see GradAccumArguments)",
    )
    parser.add_argument(
        "--cuda_sync_trace",
        action="store_true",
        help="record every host synchronisation during training with its Python stack (slower; CUDA only)",
    )
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="default",
        help="the workers' malloc: default, glibc-retain (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ fixed high) "
        "or tcmalloc (preloaded); both keep freed memory for reuse instead of page-faulting it in again",
    )
    parser.add_argument("--out", default=str(RESULTS_DIR / "throughput.json"), help="JSON path; .md and .png beside")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the results already in --out (run the rest of the grid, keep other configurations' results)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    if opts.worker:
        result = run_worker(json.loads(opts.worker))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    if opts.steps is not None and opts.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warmup)")
    if any(g < 1 for g in opts.ga):
        parser.error("--ga values must be >= 1")
    if opts.allocator == "tcmalloc":
        find_tcmalloc()  # before any worker: a missing library is an argument error, not 2 x N failed workers
    if opts.cuda_sync_trace and opts.device != "cuda":
        parser.error("--cuda_sync_trace needs --device cuda (CUDA reports the host synchronisations)")

    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if opts.rounds < 1:
        parser.error("--rounds must be >= 1")
    # Each round runs every configuration once; the two runners of a pair swap order from one round to the next, so
    # a drift of the machine does not always favour the same one.
    grid = [
        make_spec(opts, model, precision, ga, runner, round_index)
        for round_index in range(opts.rounds)
        for model in opts.models
        for precision in opts.precisions
        for ga in opts.ga
        for runner in (opts.runners if round_index % 2 == 0 else opts.runners[::-1])
    ]
    meta: dict[str, Any] = {
        "command": "python benchmarks/bench_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": opts.device,
        "tiny": opts.tiny,
        "rounds": opts.rounds,
        "metric": opts.metric,
        "steps": grid[0]["steps"] if grid else None,
        "timeout_s": opts.timeout,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **{name: metadata.version(name) for name in ("torch", "transformers", "accelerate")},
    }
    t_start = time.perf_counter()
    # --resume: keep what an earlier run into the same --out measured (a grid split over several calls, or one cut
    # short): configurations of this grid already measured (ok or skipped) are not run again, others are kept as is.
    done: dict[str, dict[str, Any]] = {}
    kept: list[dict[str, Any]] = []
    if opts.resume and out.exists():
        grid_keys = {_spec_key(spec) for spec in grid}
        for old in json.loads(out.read_text()).get("results", []):
            key = _spec_key(old["spec"])
            if key not in grid_keys:
                kept.append(old)
            elif old.get("status") in ("ok", "skipped"):
                done[key] = old
        meta["resumed_results"] = len(kept) + len(done)
    results: list[dict[str, Any]] = list(kept)
    for i, spec in enumerate(grid):
        reused = done.get(_spec_key(spec))
        result = reused if reused is not None else launch(spec, opts.timeout)
        results.append(result)
        label = f"[{i + 1}/{len(grid)}] {spec['model']} {spec['precision']} GA{spec['ga']} {spec['runner']}"
        if opts.rounds > 1:
            label += f" (round {spec['round'] + 1})"
        if result.get("status") == "ok":
            detail = (
                f"{result['samples_per_s']:.1f} samples/s, peak {result['peak_mib']:.0f} MiB, "
                f"steps {[round(t, 3) for t in result['step_times_s']]}, page faults per timed step "
                f"{result.get('page_faults_per_step')}"
            )
        else:
            detail = f"{result.get('status')}: {result.get('reason') or result.get('error')}"
        wall = "from the earlier run" if reused is not None else f"{result['process_wall_s']:.1f} s"
        print(f"{label}: {detail} ({wall})", file=sys.stderr, flush=True)
        # Written after every worker: an interrupted grid keeps what it measured (and --resume goes on from there).
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")

    first_ok = next((r for r in results if r.get("status") == "ok"), {})
    meta.update(
        total_wall_s=time.perf_counter() - t_start,
        device_name=first_ok.get("device_name", "n/a"),
        allow_tf32_matmul=first_ok.get("allow_tf32_matmul"),
        worker_versions={k: first_ok.get(k) for k in ("torch", "transformers", "accelerate")},
        counts={s: sum(r.get("status") == s for r in results) for s in ("ok", "skipped", "failed", "timeout")},
    )
    for name in ("torch", "transformers", "accelerate"):  # what the workers imported, if one ran
        meta[name] = first_ok.get(name) or meta[name]
    rows = summarize(results, opts.metric) if results else []
    md = markdown(rows, results, meta) if rows else "(empty grid)\n"
    md_path, png_path = out.with_suffix(".md"), out.with_suffix(".png")
    meta["plot"] = str(png_path) if rows and plot(rows, png_path) else None
    out.write_text(json.dumps({"meta": meta, "rows": rows, "results": results}, indent=2) + "\n")
    md_path.write_text(md)
    print(md)
    print(f"wrote {out}, {md_path}" + (f", {png_path}" if meta["plot"] else ""), file=sys.stderr)
    return 0 if meta["counts"]["failed"] == 0 and meta["counts"]["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
