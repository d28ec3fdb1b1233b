"""Memory-constrained fine-tuning, reproduced on a real GPU: under a per-process memory cap the large batch fails with
a real CUDA out-of-memory error, while the same samples accumulated with `GradAccumTrainer` fit under the same cap and
give the large-batch update.

What it runs, for two random-init models built from configs (no `datasets`, no network, synthetic data from a fixed
seed, fp32, TF32 off so that fp32 parity means something: see "Numerics" below):

- `bert`: a BERT-base-shaped `BertForSequenceClassification` (hidden 768, 12 layers, 12 heads, vocab 30522, 2 labels,
  dropout 0 so that both arms compute the same function), sequences of `--seq_len` tokens (default 128; random
  lengths between half and all of it, right-padded), a large batch of `--bert_batch` (default 256) samples;
- `resnet`: a ResNet-50-shaped `ResNetForImageClassification` (bottleneck, depths [3, 4, 6, 3]), random
  3 x `--image_size` x `--image_size` images (default 224), 10 labels, a large batch of `--resnet_batch` (default 128).
  BatchNorm normalises with the statistics of the micro-batch it sees, so N micro-batches would compute another
  function than the large batch; the model is converted with the project's `convert_batchnorm_to_groupnorm` (32 groups,
  `hf_gradaccum/helpers/normalization.py`), which normalises each sample on its own, so accumulation is exact
  (the choice for from-scratch training, which a random init is).

For each model, these arms run, EACH in its own process (this script re-invoked with `--worker ARM`, printing one
`RESULT {json}` line), so that the peak memory and the cap of each are its own (`--parallel` of them at a time,
default 4: a process's cap, peak and update do not depend on its neighbours, only its wall time does):

- `large_uncapped`: the reference. One SGD step (lr 1.0) on the whole large batch as one forward/backward, written by
  hand (`model(**batch).loss.backward()`, `p -= lr * p.grad`, as `tests/parity_cases.py:large_batch_reference`), no
  cap;
- `accumulated_uncapped` (the cap probe, only when the cap is measured): the `accumulated_capped` run without a cap;
- `large_capped`: the same code as the reference under the cap. Expected: a real `torch.OutOfMemoryError` from the
  CUDA caching allocator, caught and recorded (status `oom`);
- `accumulated_capped`: `GradAccumTrainer`, micro-batch = large / `--gradient_accumulation_steps` (default 8) x that
  many micro-batches, one optimizer step (SGD lr 1.0, no clipping, no weight decay, constant schedule), under the
  same cap. Expected: it fits (status `ok`).

The cap is `torch.cuda.set_per_process_memory_fraction` through the recipes' own `harness.arms.apply_memory_limit`
(fraction = cap MiB / the card's total memory). Unless `--cap_mb` is given, it is measured per model: halfway between
the peak `torch.cuda.max_memory_allocated` of `accumulated_uncapped` and of `large_uncapped`. The allocator
enforces the cap on the memory it reserves, which is at least what is allocated: the large batch, whose allocated
peak is above the cap, cannot fit, and the accumulated run has half the gap between the two peaks as room for
fragmentation.

Parity: each finished arm saves its update `w1 - w0` over all parameters (in `named_parameters()` order), computed in
fp64 from the fp32 weights; the parent compares `||d_ours - d_ref|| / ||d_ref||` (fp64) with the reference's
update on the same samples from the same initial weights (every arm builds the model from the same seed; a checksum
of the initial weights is compared). Tolerance: 1e-5 relative (fp32 rounding: ~1e-7).

Numerics: TF32 is turned off through the legacy flags (`torch.backends.cuda.matmul.allow_tf32 =
torch.backends.cudnn.allow_tf32 = False`) and, on torch >= 2.9, through the per-backend `fp32_precision = "ieee"`
flags too (there cuDNN convolutions default to "tf32" and the legacy flag only resets them to "none"). cuDNN is off
by default (`--cudnn off`: PyTorch's own convolution kernels, im2col + cuBLAS fp32 GEMMs): the first H100 run, with
cuDNN on and only the legacy flags set, gave the ResNet a relative update error of 6.5e-4 between batch 128 and
8 x 16 (BERT, which uses no cuDNN: 1.4e-6; the same full-size ResNet on CPU: 1.5e-6), i.e. cuDNN's fp32 convolutions
were not fp32-reproducible across batch sizes there (TF32 left on, or algorithms of lower accuracy, chosen per batch
size). `--cudnn on` / `--cudnn deterministic` measure cuDNN itself. The flags each arm ran with are in its record
(`numerics`).

Checks, per model (exit status 0 only when all pass; 1 otherwise):

- `same_initial_weights`: every arm started from the same weights;
- `large_batch_ooms` (CUDA): `large_capped` ended in a real `torch.OutOfMemoryError`;
- `accumulated_fits` (CUDA): `accumulated_capped` finished, with its peak below the cap;
- `accumulated_layout`: the Trainer ran N forward passes of large/N samples and one optimizer step;
- `parity`: `accumulated_capped` vs `large_uncapped` relative update error <= 1e-5.

With `--device cpu` no CUDA cap exists: the capped arms run without one (status `no_cap_on_cpu`), the OOM and fit
checks are skipped, and the parity comparison still runs (`--tiny` makes the models and batches tiny; this is what
`tests/test_memory_limit_repro.py` runs, so the script cannot rot on machines without a GPU). Peak memory is then the
process's peak RSS.

Output: `--out PATH.json` and `PATH.md` (a Markdown table per arm, the checks, the versions and the device name).

Commands (from the repository root). Time: on one H100 the 8 arm processes took 168 s one at a time (each 17-25 s,
of which the step itself is 0.4-1.9 s: imports and CUDA start dominate); 4 at a time (the default) is meant to
bring that near 90 s, not yet measured on the GPU. The CPU check takes about 17 s on 2 cores.

    python benchmarks/memory_limit_repro.py --out benchmarks/results/memory_limit_repro.json
    python benchmarks/memory_limit_repro.py --device cpu --tiny --out /tmp/memory_limit_repro.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run from a clone without installing: the package from the repository root, the recipes' harness from recipes/.
for _path in (ROOT / "recipes", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

RESULT_PREFIX = "RESULT "
TOLERANCE = 1e-5
LEARNING_RATE = 1.0
SEED = 0
MODELS = ("bert", "resnet")
ARMS = ("large_uncapped", "accumulated_uncapped", "large_capped", "accumulated_capped")
CAPPED_ARMS = ("large_capped", "accumulated_capped")
WORKER_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class Shapes:
    """Sizes of both models and of their batches, and the cuDNN setting every arm runs with."""

    tiny: bool
    gradient_accumulation_steps: int
    seq_len: int
    bert_batch: int
    image_size: int
    resnet_batch: int
    cudnn: str = "off"

    def large_batch(self, model: str) -> int:
        return self.bert_batch if model == "bert" else self.resnet_batch

    def micro_batch(self, model: str) -> int:
        return self.large_batch(model) // self.gradient_accumulation_steps

    def to_argv(self) -> list[str]:
        return [
            *(["--tiny"] if self.tiny else []),
            "--gradient_accumulation_steps",
            str(self.gradient_accumulation_steps),
            "--seq_len",
            str(self.seq_len),
            "--bert_batch",
            str(self.bert_batch),
            "--image_size",
            str(self.image_size),
            "--resnet_batch",
            str(self.resnet_batch),
            "--cudnn",
            self.cudnn,
        ]


def shapes_from_args(args: argparse.Namespace) -> Shapes:
    tiny_defaults = {
        "gradient_accumulation_steps": 4,
        "seq_len": 16,
        "bert_batch": 16,
        "image_size": 32,
        "resnet_batch": 16,
    }
    full_defaults = {
        "gradient_accumulation_steps": 8,
        "seq_len": 128,
        "bert_batch": 256,
        "image_size": 224,
        "resnet_batch": 128,
    }
    defaults = tiny_defaults if args.tiny else full_defaults
    values = {
        key: getattr(args, key) if getattr(args, key) is not None else default for key, default in defaults.items()
    }
    shapes = Shapes(tiny=args.tiny, cudnn=args.cudnn, **values)
    for model in MODELS:
        if shapes.large_batch(model) % shapes.gradient_accumulation_steps:
            raise SystemExit(
                f"--{model}_batch {shapes.large_batch(model)} is not a multiple of --gradient_accumulation_steps "
                f"{shapes.gradient_accumulation_steps}: the accumulated arm must see the large batch's samples."
            )
    return shapes


# ---------------------------------------------------------------------------------------------- models and data
class DictDataset(torch.utils.data.Dataset):
    """Rows of equal-length tensors as dicts, which the Trainer's `default_data_collator` stacks back into batches."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.columns.items()}


def build_bert(shapes: Shapes) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """BERT-base-shaped (or tiny) sequence classifier (random init from the seed, dropout 0) and its batch."""
    from transformers import BertConfig, BertForSequenceClassification

    size = (
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=128)
        if shapes.tiny
        else dict(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
        )
    )
    config = BertConfig(
        **size,
        max_position_embeddings=max(512, shapes.seq_len),
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
    )
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(config)
    n, seq = shapes.bert_batch, shapes.seq_len
    g = torch.Generator().manual_seed(SEED + 1)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, config.vocab_size, (n, seq), generator=g) * mask  # right padding with id 0
    columns = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (n,), generator=g)}
    description = {
        **size,
        "seq_len": seq,
        "num_labels": 2,
        "dropout": 0.0,
        "attn_implementation": getattr(config, "_attn_implementation", None),
    }
    return model, columns, description


def build_resnet(shapes: Shapes) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """ResNet-50-shaped (or tiny) image classifier with BatchNorm converted to GroupNorm, and its synthetic batch."""
    from transformers import ResNetConfig, ResNetForImageClassification

    from hf_gradaccum import convert_batchnorm_to_groupnorm

    size = (
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
        if shapes.tiny
        else dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], layer_type="bottleneck")
    )
    groups = 4 if shapes.tiny else 32
    config = ResNetConfig(num_channels=3, num_labels=10, **size)
    torch.manual_seed(SEED)
    model = convert_batchnorm_to_groupnorm(ResNetForImageClassification(config), num_groups=groups)
    n, side = shapes.resnet_batch, shapes.image_size
    g = torch.Generator().manual_seed(SEED + 1)
    columns = {
        "pixel_values": torch.randn(n, 3, side, side, generator=g),
        "labels": torch.randint(0, 10, (n,), generator=g),
    }
    description = {
        **size,
        "image_size": side,
        "num_labels": 10,
        "batchnorm": f"converted to GroupNorm ({groups} groups): convert_batchnorm_to_groupnorm",
        "converted_layers": len(getattr(model, "batchnorm_conversions", [])),
    }
    return model, columns, description


BUILDERS = {"bert": build_bert, "resnet": build_resnet}


# ------------------------------------------------------------------------------------------------------ the worker
def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, flattened in `named_parameters()` order, as one fp64 CPU vector."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for _, p in model.named_parameters()])


def configure_numerics(cudnn: str) -> dict[str, Any]:
    """fp32 really in fp32: no TF32 (it rounds matmul and convolution inputs to 10 mantissa bits), and cuDNN `on`,
    `deterministic` or `off` (PyTorch's own convolutions). Returns the flags as set."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # torch >= 2.9 also has per-backend `fp32_precision` flags; cuDNN convolutions default to "tf32" there, and the
    # legacy flag above leaves them at "none" (inherit). Name "ieee" explicitly for every one of them.
    for backend in (torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None),
                    getattr(torch.backends.cudnn, "rnn", None)):  # fmt: skip
        if backend is not None and hasattr(backend, "fp32_precision"):
            backend.fp32_precision = "ieee"
    torch.backends.cudnn.enabled = cudnn != "off"
    torch.backends.cudnn.deterministic = cudnn == "deterministic"
    return numerics_flags()


def numerics_flags() -> dict[str, Any]:
    return {
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_conv_fp32_precision": getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None),
        "matmul_fp32_precision": getattr(torch.backends.cuda.matmul, "fp32_precision", None),
    }


def large_batch_step(
    model: torch.nn.Module, columns: dict[str, torch.Tensor], device: torch.device, phase: list[str]
) -> dict[str, Any]:
    """One SGD step (lr 1.0) on the whole batch as one forward/backward, by hand: the update to match."""
    phase[0] = "model_to_device"
    model.to(device).train()
    phase[0] = "batch_to_device"
    batch = {key: value.to(device) for key, value in columns.items()}
    phase[0] = "forward"
    loss = model(**batch).loss
    phase[0] = "backward"
    loss.backward()
    phase[0] = "optimizer_step"
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(param.grad, alpha=LEARNING_RATE)
    phase[0] = "done"
    return {"loss": float(loss.detach()), "optimizer_steps": 1}


def accumulated_step(
    model: torch.nn.Module,
    columns: dict[str, torch.Tensor],
    device: torch.device,
    micro: int,
    steps: int,
    output_dir: str,
    phase: list[str],
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """One optimizer step of `GradAccumTrainer` over the same samples: `steps` micro-batches of `micro` samples."""
    import dataclasses

    from transformers import TrainingArguments

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    sampling = (
        {"train_sampling_strategy": "sequential"}
        if "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}
        else {}
    )
    args = GradAccumArguments(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps,
        learning_rate=LEARNING_RATE,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        num_train_epochs=1,
        **sampling,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
        dataloader_drop_last=False,
        dataloader_pin_memory=device.type != "cpu",
        seed=SEED,
        # Named and left unchecked (both heads are a mean over rows): the parity figure is the proof here, and the
        # first window's measurement would add forwards of other sizes to the micro-batches this reproduction reports.
        loss_normalisation="label_tokens",
        check_declared_normalisation=False,
    )
    phase[0] = "trainer_setup"
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=DictDataset(columns))
    phase[0] = "train"
    output = trainer.train()
    phase[0] = "done"
    return trainer.model, {"loss": float(output.training_loss), "optimizer_steps": int(trainer.state.global_step)}


def _is_oom(error: BaseException | None) -> BaseException | None:
    """The `torch.OutOfMemoryError` that `error` is or was raised from, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run_worker(
    arm: str, model_name: str, shapes: Shapes, device: torch.device, cap_mb: float | None, work_dir: Path
) -> dict[str, Any]:
    """Run one arm in this process and return its record; its update goes to `work_dir/<model>_<arm>_delta.pt`."""
    import accelerate
    import transformers
    from harness.arms import apply_memory_limit, peak_memory_mb

    import hf_gradaccum

    start = time.perf_counter()
    flags_before = configure_numerics(shapes.cudnn)
    capped = arm.endswith("_capped")
    record: dict[str, Any] = {
        "model": model_name,
        "arm": arm,
        "device": str(device),
        "micro_batch_size": shapes.micro_batch(model_name)
        if arm.startswith("accumulated")
        else shapes.large_batch(model_name),
        "gradient_accumulation_steps": shapes.gradient_accumulation_steps if arm.startswith("accumulated") else 1,
        "cap_mb": None,
        "cap": "no cap",
        "error": None,
        "relative_update_error": None,
    }
    record["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "hf_gradaccum": hf_gradaccum.__version__,
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        record["device_name"] = torch.cuda.get_device_name(index)
        record["device_total_mb"] = torch.cuda.get_device_properties(index).total_memory / 2**20
        if capped:
            if cap_mb is None:
                raise SystemExit(f"arm {arm} needs --cap_mb on CUDA")
            record["cap"] = apply_memory_limit(cap_mb, device)
            record["cap_mb"] = cap_mb
        torch.cuda.reset_peak_memory_stats(index)
    else:
        record["device_name"] = (
            f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        )
        if capped:
            record["cap"] = "no per-process memory cap on CPU: the arm runs uncapped"
    record["memory_kind"] = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"

    model, columns, record["model_config"] = BUILDERS[model_name](shapes)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    w0 = flat_parameters(model)
    record["initial_weights_checksum"] = [float(w0.sum()), float(w0.norm())]
    micro_batches: list[int] = []

    def count_rows(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training:
            first = next(iter(kwargs.values()), None) if kwargs else (args[0] if args else None)
            micro_batches.append(int(first.shape[0]) if isinstance(first, torch.Tensor) else -1)

    model.register_forward_pre_hook(count_rows, with_kwargs=True)
    phase = ["build"]
    step_start = time.perf_counter()
    try:
        if arm.startswith("large"):
            stats = large_batch_step(model, columns, device, phase)
        else:
            model, stats = accumulated_step(
                model,
                columns,
                device,
                shapes.micro_batch(model_name),
                shapes.gradient_accumulation_steps,
                str(work_dir / f"trainer_{model_name}"),
                phase,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record.update(stats)
        record["status"] = "no_cap_on_cpu" if capped and device.type != "cuda" else "ok"
    except Exception as error:  # noqa: BLE001 - every failure is recorded; the parent judges it
        oom = _is_oom(error)
        record["status"] = "oom" if oom is not None else "error"
        record["exception_type"] = type(oom or error).__name__
        record["error"] = (str(oom or error).strip().splitlines() or [""])[0][:400]
        record["failed_in"] = phase[0]
    record["step_time_s"] = time.perf_counter() - step_start
    record["numerics"] = {"set": flags_before, "after_the_step": numerics_flags()}
    record["micro_batches_seen"] = micro_batches
    record["peak_memory_mb"] = peak_memory_mb(device)
    if device.type == "cuda":
        record["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    if record["error"] is None:
        delta_path = work_dir / f"{model_name}_{arm}_delta.pt"
        torch.save(flat_parameters(model) - w0, delta_path)
        record["delta_path"] = str(delta_path)
    record["wall_time_s"] = time.perf_counter() - start
    return record


# ------------------------------------------------------------------------------------------------------ the parent
def launch_worker(
    arm: str, model_name: str, shapes: Shapes, device: str, cap_mb: float | None, work_dir: Path
) -> dict[str, Any]:
    """Run one arm in a fresh process and return its `RESULT` record (status `crashed` if it printed none)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        arm,
        "--model",
        model_name,
        "--device",
        device,
        "--work_dir",
        str(work_dir),
        *shapes.to_argv(),
    ]
    if cap_mb is not None:
        command += ["--cap_mb", f"{cap_mb:.1f}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # one GPU: the Trainer would wrap the model in DataParallel on several
    print(
        f"--- {model_name} / {arm}: started" + (f" (cap {cap_mb:,.0f} MiB)" if cap_mb is not None else ""), flush=True
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as expired:
        stdout, stderr, returncode = str(expired.stdout or ""), f"timed out after {WORKER_TIMEOUT_S:.0f} s", -1
    process_time = time.perf_counter() - start
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if lines:
        record = json.loads(lines[-1][len(RESULT_PREFIX) :])
    else:
        tail = [line for line in (stderr or "").strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        record = {
            "model": model_name,
            "arm": arm,
            "status": "crashed",
            "error": f"exit {returncode}: {tail[0]}",
            "cap_mb": cap_mb,
            "relative_update_error": None,
        }
        sys.stderr.write(stderr[-4000:])
    record["process_wall_time_s"] = process_time
    summary = f"status {record['status']}"
    if record.get("peak_memory_mb") is not None:
        summary += f", peak {record['peak_memory_mb']:,.0f} MiB"
    if record.get("error"):
        summary += f", {record.get('exception_type', '')}: {record['error'][:160]}"
    print(f"--- {model_name} / {arm}: {summary}; {process_time:.1f} s in its own process", flush=True)
    return record


def relative_update_error(delta_path: str, reference_path: str) -> float:
    """`||d - d_ref|| / ||d_ref||` in fp64 over all parameters."""
    delta = torch.load(delta_path, map_location="cpu", weights_only=True)
    reference = torch.load(reference_path, map_location="cpu", weights_only=True)
    if delta.shape != reference.shape:
        raise ValueError(f"updates of different sizes: {tuple(delta.shape)} vs {tuple(reference.shape)}")
    return float((delta - reference).norm() / reference.norm())


def measured_cap_mb(probe: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """Halfway between the accumulated and the large-batch peaks, or None when either is missing."""
    low, high = probe.get("peak_memory_mb"), reference.get("peak_memory_mb")
    if probe.get("status") != "ok" or reference.get("status") != "ok" or low is None or high is None:
        return None
    return (low + high) / 2


def judge_model(
    model_name: str, shapes: Shapes, arms: dict[str, dict[str, Any]], cuda: bool, cap_mb: float | None
) -> dict[str, dict[str, Any]]:
    """The model's checks: `{name: {"passed": bool | None (not applicable), "detail": str}}`."""
    checks: dict[str, dict[str, Any]] = {}
    reference, large, accumulated = arms["large_uncapped"], arms["large_capped"], arms["accumulated_capped"]
    sums = {tuple(a["initial_weights_checksum"]) for a in arms.values() if a.get("initial_weights_checksum")}
    checks["same_initial_weights"] = {
        "passed": len(sums) == 1 and all(a.get("initial_weights_checksum") for a in arms.values()),
        "detail": f"{len(sums)} distinct initial-weight checksum(s) over {len(arms)} arms",
    }
    if cuda:
        checks["large_batch_ooms"] = {
            "passed": large.get("status") == "oom" and large.get("exception_type") == "OutOfMemoryError",
            "detail": f"large_capped: {large.get('status')} in {large.get('failed_in', '-')} "
            f"({large.get('exception_type', '-')}) under a cap of {cap_mb or 0:,.0f} MiB",
        }
        peak = accumulated.get("peak_memory_mb")
        checks["accumulated_fits"] = {
            "passed": accumulated.get("status") == "ok" and cap_mb is not None and peak is not None and peak <= cap_mb,
            "detail": f"accumulated_capped: {accumulated.get('status')}, peak {peak or 0:,.0f} MiB <= cap "
            f"{cap_mb or 0:,.0f} MiB",
        }
    else:
        for name in ("large_batch_ooms", "accumulated_fits"):
            checks[name] = {"passed": None, "detail": "no per-process memory cap on CPU (status no_cap_on_cpu)"}
    micro, steps = shapes.micro_batch(model_name), shapes.gradient_accumulation_steps
    seen = accumulated.get("micro_batches_seen")
    checks["accumulated_layout"] = {
        "passed": seen == [micro] * steps and accumulated.get("optimizer_steps") == 1,
        "detail": f"forward passes of {seen} samples (expected {steps} x {micro}), "
        f"{accumulated.get('optimizer_steps')} optimizer step(s) (expected 1)",
    }
    error = accumulated.get("relative_update_error")
    checks["parity"] = {
        "passed": error is not None and error <= TOLERANCE,
        "detail": f"accumulated_capped vs large_uncapped: relative update error "
        f"{'n/a' if error is None else f'{error:.2e}'} (tolerance {TOLERANCE:.0e})",
    }
    if reference.get("status") != "ok":
        checks["parity"]["detail"] += f"; the reference failed: {reference.get('error')}"
    return checks


def run_arms(
    jobs: Sequence[tuple[str, str, float | None]], shapes: Shapes, device: str, work_dir: Path, parallel: int
) -> dict[tuple[str, str], dict[str, Any]]:
    """Run `(model, arm, cap_mb)` jobs, each in its own process, `parallel` processes at a time.

    Each process has its own CUDA caching allocator, its own cap and its own peak, so running arms side by side
    changes neither their memory figures nor their updates (only their wall times); it saves the process starts
    (imports and CUDA initialisation: most of the run). All of them together need well under the card's memory.
    """
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {
            (model, arm): pool.submit(launch_worker, arm, model, shapes, device, cap_mb, work_dir)
            for model, arm, cap_mb in jobs
        }
        return {key: future.result() for key, future in futures.items()}


def not_run(model_name: str, arm: str, reason: str) -> dict[str, Any]:
    return {"model": model_name, "arm": arm, "status": "not_run", "error": reason, "relative_update_error": None}


def run_all(
    models: Sequence[str], shapes: Shapes, device: str, cap_override: float | None, work_dir: Path, parallel: int
) -> dict[str, dict[str, Any]]:
    """Every model's arms and checks. On CUDA without `--cap_mb`, first the uncapped arms (the reference and the cap
    probe), then the capped arms under the cap measured from them; otherwise all arms at once."""
    cuda = device.startswith("cuda")
    probe = cuda and cap_override is None
    first = [(m, "large_uncapped", None) for m in models] + [
        (m, "accumulated_uncapped", None) for m in models if probe
    ]
    caps: dict[str, float | None] = {m: cap_override if cuda else None for m in models}
    if probe:
        records = run_arms(first, shapes, device, work_dir, parallel)
        for m in models:
            caps[m] = measured_cap_mb(records[(m, "accumulated_uncapped")], records[(m, "large_uncapped")])
            if caps[m] is None:
                print(f"    no cap for {m}: an uncapped arm failed", flush=True)
        second = [(m, arm, caps[m]) for m in models for arm in CAPPED_ARMS if caps[m] is not None]
        records.update(run_arms(second, shapes, device, work_dir, parallel))
    else:
        second = [(m, arm, caps[m]) for m in models for arm in CAPPED_ARMS]
        records = run_arms(first + second, shapes, device, work_dir, parallel)
    if probe:
        rule = "halfway between the peaks of accumulated_uncapped and large_uncapped"
    else:
        rule = "--cap_mb" if cuda else "no cap: CPU"
    return {m: judge_arms(m, shapes, records, cuda, caps[m], rule) for m in models}


def judge_arms(
    model_name: str,
    shapes: Shapes,
    records: dict[tuple[str, str], dict[str, Any]],
    cuda: bool,
    cap_mb: float | None,
    cap_rule: str,
) -> dict[str, Any]:
    """One model's arms with their relative update errors, and its checks."""
    arms = {arm: record for (model, arm), record in records.items() if model == model_name}
    for arm in CAPPED_ARMS:
        arms.setdefault(arm, not_run(model_name, arm, "no cap could be measured"))
    reference_path = arms["large_uncapped"].get("delta_path")
    for arm, record in arms.items():
        if arm != "large_uncapped" and reference_path and record.get("delta_path"):
            record["relative_update_error"] = relative_update_error(record["delta_path"], reference_path)
    for record in arms.values():
        if record.get("delta_path"):
            Path(record.pop("delta_path")).unlink(missing_ok=True)
    checks = judge_model(model_name, shapes, arms, cuda, cap_mb)
    return {
        "large_batch": shapes.large_batch(model_name),
        "micro_batch": shapes.micro_batch(model_name),
        "gradient_accumulation_steps": shapes.gradient_accumulation_steps,
        "cap_mb": cap_mb,
        "cap_rule": cap_rule,
        "arms": [arms[arm] for arm in ARMS if arm in arms],
        "checks": checks,
        "passed": all(check["passed"] is not False for check in checks.values()),
    }


# ------------------------------------------------------------------------------------------------------ report
def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "**FAIL**")


def arm_expectation(record: dict[str, Any], cuda: bool) -> str:
    """The table's memory column: did the arm do what the cap is for?"""
    arm = record["arm"]
    if arm not in ("large_capped", "accumulated_capped"):
        return "-"
    if not cuda:
        return "n/a (no cap on CPU)"
    if arm == "large_capped":
        return f"OOM expected: {_verdict(record.get('status') == 'oom')}"
    fits = record.get("status") == "ok" and (record.get("peak_memory_mb") or 0) <= (record.get("cap_mb") or 0)
    return f"fits expected: {_verdict(fits)}"


def render_markdown(report: dict[str, Any]) -> str:
    cuda = report["device"].startswith("cuda")
    memory = "peak `torch.cuda.max_memory_allocated`" if cuda else "peak RSS of the process"
    cudnn = f", cuDNN {report['shapes']['cudnn']}" if cuda else ""
    lines = [
        "# Memory-constrained fine-tuning: the large batch OOMs, the accumulated run fits and matches",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Device: {report['device_name']} ({report['device']}). Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        "",
        f"One SGD step (lr {LEARNING_RATE}), fp32, TF32 off{cudnn}; "
        f"relative update error `||d_ours - d_ref|| / ||d_ref||` "
        f"over all parameters against `large_uncapped` (the large batch by hand, no cap), tolerance "
        f"{report['tolerance']:.0e}. Peak MB: {memory} (MiB). Cap: `torch.cuda.set_per_process_memory_fraction`, "
        f"via `harness.arms.apply_memory_limit`.",
        "",
        "| model | arm | layout | status | peak MB | cap MB | time s | rel. update error | parity <= 1e-5 | memory |",
        "|---|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for model_name, result in report["models"].items():
        for record in result["arms"]:
            error = record.get("relative_update_error")
            layout = f"{record.get('micro_batch_size', '?')} x {record.get('gradient_accumulation_steps', '?')}"
            parity = "-" if record["arm"] == "large_uncapped" or error is None else _verdict(error <= TOLERANCE)
            if record["arm"] == "large_capped":
                parity = "-"  # the same code as the reference: not the comparison under test
            lines.append(
                f"| {model_name} | {record['arm']} | {layout} | {record['status']} | "
                f"{_fmt(record.get('peak_memory_mb'))} | {_fmt(record.get('cap_mb'))} | "
                f"{_fmt(record.get('process_wall_time_s'), '.1f')} | {_fmt(error, '.2e')} | {parity} | "
                f"{arm_expectation(record, cuda)} |"
            )
    lines += [
        "",
        f"Time s: the arm's whole process (start, imports, model build, the step, saving its update), "
        f"{report['parallel']} arm process(es) at a time.",
        "",
    ]
    for model_name, result in report["models"].items():
        lines.append(f"## {model_name}: {'pass' if result['passed'] else 'FAIL'}")
        lines.append("")
        config = next((r.get("model_config") for r in result["arms"] if r.get("model_config")), {})
        lines.append(
            f"Large batch {result['large_batch']} = {result['micro_batch']} x "
            f"{result['gradient_accumulation_steps']}; cap {_fmt(result['cap_mb'])} MiB "
            f"({result['cap_rule']}). Model: {json.dumps(config)}."
        )
        lines.append("")
        for name, check in result["checks"].items():
            lines.append(f"- `{name}`: {_verdict(check['passed'])}: {check['detail']}")
        oom = next((r for r in result["arms"] if r["arm"] == "large_capped" and r.get("status") == "oom"), None)
        if oom is not None:
            lines.append(f"- the large batch's error ({oom['failed_in']}): `{oom['exception_type']}: {oom['error']}`")
        lines.append("")
    lines.append(f"Overall: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (the reproduction) or cpu (the smoke test).")
    parser.add_argument("--tiny", action="store_true", help="Tiny models and batches (the CPU test).")
    parser.add_argument(
        "--cudnn",
        choices=("on", "deterministic", "off"),
        default="off",
        help="cuDNN for the convolutions (the ResNet): off (default: PyTorch's own kernels), on, or deterministic.",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="Comma-separated subset of bert,resnet.")
    parser.add_argument(
        "--cap_mb",
        type=float,
        default=None,
        help="Memory cap in MiB for the capped arms (default: measured per model, see above).",
    )
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None, help="Default 8 (tiny: 4).")
    parser.add_argument("--seq_len", type=int, default=None, help="BERT sequence length. Default 128 (tiny: 16).")
    parser.add_argument("--bert_batch", type=int, default=None, help="BERT large batch. Default 256 (tiny: 16).")
    parser.add_argument("--image_size", type=int, default=None, help="ResNet image side. Default 224 (tiny: 32).")
    parser.add_argument("--resnet_batch", type=int, default=None, help="ResNet large batch. Default 128 (tiny: 16).")
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks" / "results" / "memory_limit_repro.json"),
        help="Where to write the JSON report; the Markdown goes next to it (.md).",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=4,
        help="Arm processes run at a time (default 4; 1: one after the other, for wall times without contention).",
    )
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = shapes_from_args(args)

    if args.worker is not None:
        record = run_worker(
            args.worker, args.model, shapes, torch.device(args.device), args.cap_mb, Path(args.work_dir)
        )
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; use --device cpu --tiny for the CPU smoke test.")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memory_limit_repro_") as work_dir:
        results = run_all(models, shapes, args.device, args.cap_mb, Path(work_dir), args.parallel)
    any_record = next((r for res in results.values() for r in res["arms"] if r.get("versions")), {})
    report = {
        "command": shlex.join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]),
        "device": args.device,
        "device_name": any_record.get("device_name", "unknown"),
        "versions": any_record.get("versions", {"torch": torch.__version__}),
        "tolerance": TOLERANCE,
        "learning_rate": LEARNING_RATE,
        "shapes": asdict(shapes),
        "parallel": args.parallel,
        "models": results,
        "total_wall_time_s": time.perf_counter() - start,
        "passed": all(result["passed"] for result in results.values()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    out.with_suffix(".md").write_text(markdown)
    print("\n" + markdown)
    print(f"wrote {out} and {out.with_suffix('.md')} in {report['total_wall_time_s']:.0f} s", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
