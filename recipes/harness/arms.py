"""Arms of a parity experiment: the same fine-tune run as the large batch, accumulated, and plain small batch, each in
its own process so that its peak memory is its own.

An arm name is `<kind>` or `<kind>_<batchnorm>`:

- kind `reference`: the large batch itself, `micro * N` samples per micro-batch, no accumulation (what you would run
  if the memory were there);
- kind `accumulated`: `micro` samples per micro-batch, `N` micro-batches per optimizer step (what this project makes
  exact);
- kind `small_batch`: `micro` samples per step and no accumulation, for the same number of epochs (what people do
  when the large batch does not fit);
- kind `noise_floor`: the reference with every weight perturbed by 1e-7 relative before training: the drift that
  fp32 rounding alone causes (an accumulated arm and the reference differ by about one rounding after their first
  step; networks with ReLU/max-pool kinks amplify such differences over the following steps);
- optional suffix `keep | groupnorm | freeze | momentum`: how BatchNorm layers are treated in that arm (see
  `hf_gradaccum.helpers.normalization`); without a suffix the recipe's `batchnorm` option applies.

A non-reference arm is compared with `reference_<batchnorm>` when that arm is run (GroupNorm against GroupNorm),
otherwise with `reference`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import ProgressCallback

from hf_gradaccum.config.arguments import accelerator_available

from .reporting import build_parity_report, format_summary, write_parity_report

ARM_KINDS = ("reference", "accumulated", "small_batch", "noise_floor")
#: Relative size of the weight perturbation of a `noise_floor` arm: about one fp32 rounding (2**-24 ~ 6e-8).
NOISE_FLOOR_PERTURBATION = 1e-7
BATCHNORM_MODES = ("keep", "groupnorm", "freeze", "momentum")
ARM_RESULT_FILE = "arm_result.json"
ARM_WEIGHTS_FILE = "weights.safetensors"
ARM_LOG_FILE = "arm.log"  # the arm process's full console output


@dataclass
class ParityArguments:
    """Options of the parity experiment shared by the recipes: which arms to run and the memory limit."""

    arms: list[str] = field(
        default_factory=lambda: ["reference", "accumulated", "small_batch"],
        metadata={
            "help": "Arms to run, each in its own subprocess: reference (micro x N samples, 1 micro-batch per step), "
            "accumulated (micro samples x N micro-batches), small_batch (micro samples, 1 micro-batch per step), "
            "noise_floor (the reference with every weight perturbed by 1e-7 relative: how far fp32 rounding alone "
            "moves the large-batch run), optionally suffixed _keep/_groupnorm/_freeze/_momentum for the BatchNorm treatment."
        },
    )
    max_memory_mb: float | None = field(
        default=None,
        metadata={
            "help": "Emulated device memory in MiB. On CUDA each arm is capped with "
            "torch.cuda.set_per_process_memory_fraction (an arm that needs more fails with OOM); on CPU peak RSS is "
            "measured and the report says which arms would not have fit."
        },
    )
    loss_tolerance: float = field(
        default=1e-4,
        metadata={"help": "Largest per-step |train loss difference| vs the reference for an arm to count as a match."},
    )
    keep_arm_outputs: bool = field(
        default=False,
        metadata={
            "help": "Keep each arm's final weights (arms/<arm>/weights.safetensors) after the report is written."
        },
    )
    run_single_arm: str | None = field(
        default=None,
        metadata={
            "help": "Internal: run only this arm, in this process, and write arms/<arm>/arm_result.json. The "
            "parent process sets it for each child; handy to debug one arm."
        },
    )

    def __post_init__(self) -> None:
        if self.max_memory_mb is not None and not (0 < self.max_memory_mb < float("inf")):
            raise ValueError(f"`max_memory_mb` must be > 0 (or null for no limit), got {self.max_memory_mb}.")
        if not (0 <= self.loss_tolerance < float("inf")):
            raise ValueError(f"`loss_tolerance` must be >= 0, got {self.loss_tolerance}.")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"`arms` lists an arm twice: {self.arms}.")
        for name in self.arms:
            parse_arm_name(name)
        if self.run_single_arm is not None and self.run_single_arm not in self.arms:
            raise ValueError(f"`run_single_arm={self.run_single_arm!r}` is not one of `arms` {self.arms}.")


@dataclass(frozen=True)
class ArmSpec:
    """One arm: its batch layout and BatchNorm treatment."""

    name: str
    kind: str
    batchnorm: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    compared_to: str | None

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step on one process."""
        return self.micro_batch_size * self.gradient_accumulation_steps


def parse_arm_name(name: str) -> tuple[str, str | None]:
    """
    Split an arm name into its kind and optional BatchNorm suffix.

    Example:

    ```python
    >>> from harness.arms import parse_arm_name
    >>> parse_arm_name("accumulated_groupnorm"), parse_arm_name("small_batch")
    (('accumulated', 'groupnorm'), ('small_batch', None))
    ```
    """
    for kind in ARM_KINDS:
        if name == kind:
            return kind, None
        if name.startswith(kind + "_") and name[len(kind) + 1 :] in BATCHNORM_MODES:
            return kind, name[len(kind) + 1 :]
    raise ValueError(
        f"Unknown arm {name!r}: expected one of {list(ARM_KINDS)}, optionally followed by _<batchnorm> with "
        f"<batchnorm> in {list(BATCHNORM_MODES)} (e.g. 'accumulated_groupnorm')."
    )


def plan_arms(
    names: Sequence[str], *, micro_batch_size: int, gradient_accumulation_steps: int, batchnorm: str = "keep"
) -> list[ArmSpec]:
    """
    Turn arm names into [`ArmSpec`]s from the accumulated layout (`micro_batch_size` x `gradient_accumulation_steps`).

    Example:

    ```python
    >>> from harness.arms import plan_arms
    >>> [(a.name, a.micro_batch_size, a.gradient_accumulation_steps, a.compared_to)
    ...  for a in plan_arms(["reference", "accumulated"], micro_batch_size=8, gradient_accumulation_steps=4)]
    [('reference', 32, 1, None), ('accumulated', 8, 4, 'reference')]
    ```
    """
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"`batchnorm` must be one of {list(BATCHNORM_MODES)}, got {batchnorm!r}.")
    specs = []
    for name in names:
        kind, suffix = parse_arm_name(name)
        mode = suffix or batchnorm
        if kind == "reference":
            micro, steps, compared_to = micro_batch_size * gradient_accumulation_steps, 1, None
        elif kind == "noise_floor":
            micro, steps = micro_batch_size * gradient_accumulation_steps, 1
            compared_to = _reference_for(mode, names, batchnorm)
        else:
            micro, steps = micro_batch_size, gradient_accumulation_steps if kind == "accumulated" else 1
            compared_to = _reference_for(mode, names, batchnorm)
        specs.append(ArmSpec(name, kind, mode, micro, steps, compared_to))
    return specs


def _reference_for(mode: str, names: Sequence[str], batchnorm: str) -> str | None:
    # Compare like with like: a GroupNorm arm with a GroupNorm reference. `keep` and `momentum` are the same model
    # at one micro-batch per step (the momentum correction is the identity for N = 1), so they share a reference.
    def same_model(a: str, b: str) -> bool:
        return a == b or {a, b} <= {"keep", "momentum"}

    if f"reference_{mode}" in names:
        return f"reference_{mode}"
    if "reference" in names and same_model(mode, batchnorm):
        return "reference"
    return None


def perturb_for_noise_floor(model: torch.nn.Module, *, relative: float = NOISE_FLOOR_PERTURBATION, seed: int = 0):
    """
    Multiply every trainable weight by `1 + relative * e` with `e ~ N(0, 1)` from a fixed seed: the `noise_floor`
    arm's model. Two mathematically equal fp32 computations (one batch of 64, or 8 micro-batches of 8) differ by
    about this much after one step, so how far this arm drifts from the reference bounds the drift that rounding
    alone can cause; networks with ReLU/max-pool kinks amplify it step after step, smooth ones (GELU BERT) do not.

    Example:

    ```python
    >>> import torch
    >>> from harness.arms import perturb_for_noise_floor
    >>> layer = torch.nn.Linear(4, 4)
    >>> before = layer.weight.detach().clone()
    >>> _ = perturb_for_noise_floor(layer)
    >>> 0 < float((layer.weight - before).norm() / before.norm()) < 1e-6
    True
    ```
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.mul_(1 + relative * noise.to(device=param.device, dtype=param.dtype))
    return model


def arm_overrides(spec: ArmSpec, output_dir: str | Path) -> list[str]:
    """
    Command-line flags that turn the user's training arguments into this arm's: its batch layout, its own output
    folder, one log per optimizer step (the per-step loss curve is the parity check), no checkpoints and no mid-run
    evaluation (each arm is evaluated once at the end). Appended last, they override the YAML and the command line.

    Example:

    ```python
    >>> from harness.arms import plan_arms, arm_overrides
    >>> spec = plan_arms(["reference"], micro_batch_size=8, gradient_accumulation_steps=4)[0]
    >>> arm_overrides(spec, "out")[:4]
    ['--per_device_train_batch_size', '32', '--gradient_accumulation_steps', '1']
    ```
    """
    overrides = {
        "per_device_train_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "output_dir": arm_dir(output_dir, spec.name),
        **per_arm_settings(),
    }
    return [
        token
        for key, value in overrides.items()
        for token in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))
    ]


def per_arm_settings() -> dict[str, Any]:
    """
    Training arguments every arm runs with, whatever the YAML or the command line say (the recipes' `--help` shows
    them as their defaults): one log per optimizer step, no checkpoints, no mid-run evaluation, and no pinned memory
    without an accelerator.

    Example:

    ```python
    >>> from harness.arms import per_arm_settings
    >>> per_arm_settings()["logging_steps"]
    1
    ```
    """
    settings: dict[str, Any] = {
        "logging_strategy": "steps",
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
    }
    if not accelerator_available():
        # Pinned memory needs an accelerator; without one the DataLoader warns on every arm.
        settings["dataloader_pin_memory"] = False
    return settings


# ---------------------------------------------------------------------------------------------------- subprocesses
def is_rank_zero() -> bool:
    """
    Whether this process is the first of a multi-process launch (`RANK` 0), or the only process.

    The recipes' parent process and each arm's children read the launcher's `RANK` (the children inherit it), so
    progress and summary lines printed where it is `True` appear once, not once per process.

    Example:

    ```python
    >>> from harness.arms import is_rank_zero
    >>> is_rank_zero()  # outside a launch
    True
    ```
    """
    return int(os.environ.get("RANK", "0")) == 0


def run_arms_in_subprocesses(
    specs: Sequence[ArmSpec], *, script: str | Path, argv: Sequence[str], output_dir: str | Path
) -> list[dict[str, Any]]:
    """
    Run each arm as `python <script> <argv> --run_single_arm <arm>` and collect its `arm_result.json`.

    One process per arm makes the peak memory of each arm its own (a process never gives its peak back). The
    children inherit the environment, so `accelerate launch` settings apply to them; under a multi-process launch
    each rank starts its own child and the children of one arm form their own process group on `MASTER_PORT + 1 + i`.

    Returns:
        `list[dict]`: one result per arm (see [`collect_arm_result`]); a child that crashed gives `status="failed"`.
    """
    results = []
    main_process = is_rank_zero()  # prints the progress lines; a failed arm is said by every process it failed in
    for index, spec in enumerate(specs):
        env = dict(os.environ)
        if "MASTER_PORT" in env:
            env["MASTER_PORT"] = str(int(env["MASTER_PORT"]) + 1 + index)
            # torchrun tells its workers to join the launcher's own store instead of hosting one; the arm's
            # children have their own rendezvous, where rank 0 must host the store (else every rank waits forever).
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        command = [sys.executable, str(script), *argv, "--run_single_arm", spec.name]
        if main_process:
            print(f"\n=== arm {index + 1}/{len(specs)}: {spec.name} ({describe_layout(spec)}) ===", flush=True)
        log_path = arm_dir(output_dir, spec.name) / ARM_LOG_FILE
        start = time.perf_counter()
        returncode = run_teed(command, env=env, log_path=log_path)
        wall_time = time.perf_counter() - start
        result_file = arm_dir(output_dir, spec.name) / ARM_RESULT_FILE
        if returncode == 0 and result_file.is_file():
            result = json.loads(result_file.read_text())
        else:
            cause = last_error_line(log_path) or f"the arm's process exited with code {returncode}"
            result = failed_arm_result(spec, cause)
            result["log"] = str(log_path)
        result["process_wall_time_s"] = wall_time
        results.append(result)
        if result["status"] == "failed":
            where = "" if main_process else f" in process {os.environ['RANK']}"
            print(f"=== arm {spec.name} failed{where}: {result['error']} (full log: {log_path}) ===", flush=True)
        elif main_process:
            print(f"=== arm {spec.name}: {arm_outcome(result)}; {wall_time:.0f} s in its own process ===", flush=True)
    return results


def run_teed(command: Sequence[str], *, env: dict[str, str], log_path: Path) -> int:
    """Run `command`, streaming its output (progress bars included) to this console and to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(log_path, "wb") as log,
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process,
    ):
        # Raw chunks, not lines: tqdm redraws its bar with carriage returns and no newline.
        while chunk := process.stdout.read1(65536):
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return process.wait()


def last_error_line(log_path: Path) -> str | None:
    """The last `SomeError: message` line of a log (the exception that ended the process), if any."""
    if not log_path.is_file():
        return None
    lines = log_path.read_text(errors="replace").replace("\r", "\n").splitlines()
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*", line.strip()):
            return line.strip()
    return None


def arm_outcome(result: dict[str, Any]) -> str:
    """`"accuracy 0.781, peak memory 1,204 MiB"` or `"failed: ..."`: one line per finished arm."""
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error')}"
    accuracy = result["eval_metrics"].get("eval_accuracy")
    score = f"accuracy {accuracy:.3f}, " if accuracy is not None else ""
    return f"{score}final train loss {result['train_loss'][-1]:.4f}, peak memory {result['peak_memory_mb']:,.0f} MiB"


def arm_dir(output_dir: str | Path, name: str) -> Path:
    """Where an arm writes its Trainer output, result and weights."""
    return Path(output_dir) / "arms" / name


def describe_layout(spec: ArmSpec) -> str:
    """`"8 x 4 = 32 samples/step, BatchNorm: keep"`."""
    return (
        f"{spec.micro_batch_size} x {spec.gradient_accumulation_steps} = {spec.effective_batch_size} samples/step"
        f", BatchNorm: {spec.batchnorm}"
    )


def launch_command(script: str | Path, argv: Sequence[str]) -> str:
    """
    The exact command that started the recipe, for the report. Under `accelerate launch` this process's own command
    line does not show the launcher's options, so the launcher's command line is read from the parent process
    (`/proc`, Linux); elsewhere the `accelerate launch` prefix is reconstructed without its options.
    """
    script_and_args = shlex.join([os.path.relpath(script, Path.cwd()), *argv])
    if not any(key.startswith("ACCELERATE_") for key in os.environ):
        return f"python {script_and_args}"
    launcher = _accelerate_launcher_command()
    return launcher if launcher is not None else f"accelerate launch {script_and_args}"


def _accelerate_launcher_command() -> str | None:
    """`accelerate launch --config_file ... script.py ...` from the nearest ancestor process that ran it."""
    pid = os.getppid()
    for _ in range(4):  # accelerate launch -> (torchrun agent) -> this process
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if "launch" in args:
            start = args.index("launch")
            return shlex.join(["accelerate", *args[start:]])
        match = re.search(r"^PPid:\s+(\d+)", status, re.MULTILINE)
        if match is None or int(match.group(1)) <= 1:
            return None
        pid = int(match.group(1))
    return None


def describe_device(device: torch.device) -> str:
    """`"cpu (2 threads)"` or `"cuda:0 (NVIDIA H100 80GB HBM3)"`."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device.type} ({torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------------------------------- memory
def apply_memory_limit(max_memory_mb: float | None, device: torch.device) -> str:
    """
    Emulate a device with `max_memory_mb` MiB. On CUDA the caching allocator of this process is capped (a larger
    allocation raises `torch.OutOfMemoryError`); elsewhere nothing can be capped faithfully, so the limit is only
    compared with the measured peak afterwards.

    Returns:
        `str`: a sentence saying what was done, for the log.
    """
    if max_memory_mb is None:
        return "no memory limit"
    if device.type == "cuda":
        # `torch.device("cuda")` names no index, which `set_per_process_memory_fraction` refuses: use the current one.
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, max_memory_mb * 2**20 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        return f"CUDA allocator capped at {max_memory_mb:.0f} MiB ({fraction:.1%} of {total / 2**20:.0f} MiB)"
    return f"{device.type}: memory is measured (peak RSS) and compared with the {max_memory_mb:.0f} MiB limit"


def memory_kind(device: torch.device) -> str:
    """What [`peak_memory_mb`] measures on `device`: `"cuda_max_allocated"` or `"cpu_peak_rss"`."""
    return "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA tensors allocated, or the process's resident set size."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil  # a dependency of accelerate

    return psutil.Process().memory_info().rss / 2**20


def peak_memory_mb(device: torch.device) -> float:
    """
    Peak memory of this process: `torch.cuda.max_memory_allocated` on CUDA, otherwise the peak resident set size
    (`getrusage(RUSAGE_SELF).ru_maxrss`, which counts Python, torch and the data too, not just tensors).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on CUDA (the RSS peak of a process cannot be reset: that is why arms run in subprocesses)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------------- results
def collect_arm_result(
    spec: ArmSpec,
    trainer: Any,
    *,
    train_metrics: dict[str, float],
    eval_metrics: dict[str, float],
    peak_memory_mb: float,
    baseline_memory_mb: float,
    wall_time_s: float,
    batchnorm_layers: int = 0,
) -> dict[str, Any]:
    """
    Everything the report needs from one finished arm, as a JSON-ready dict: layout, per-step train loss from
    `trainer.state.log_history` (the Trainer logs every step with `logging_steps=1`), eval metrics, memory, speed.

    `peak_memory_mb` should be read with [`peak_memory_mb`] right after `trainer.train()`, so that evaluation and
    saving (which copy weights) do not count.
    """
    device = trainer.args.device
    return {
        "name": spec.name,
        "kind": spec.kind,
        "status": "ok",
        "error": None,
        "batchnorm": spec.batchnorm,
        "batchnorm_layers": batchnorm_layers,
        "compared_to": spec.compared_to,
        "micro_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "world_size": trainer.args.world_size,
        "effective_batch_size": spec.effective_batch_size * trainer.args.world_size,
        "optimizer_steps": trainer.state.global_step,
        "epochs": float(trainer.state.epoch or 0.0),
        "train_loss": train_losses_from_log_history(trainer.state.log_history),
        "eval_metrics": {k: float(v) for k, v in eval_metrics.items() if isinstance(v, (int, float))},
        "peak_memory_mb": peak_memory_mb,
        "baseline_memory_mb": baseline_memory_mb,
        "memory_kind": memory_kind(device),
        "train_samples_per_second": float(train_metrics.get("train_samples_per_second", 0.0)),
        "train_runtime_s": float(train_metrics.get("train_runtime", 0.0)),
        "wall_time_s": wall_time_s,
        "skipped_steps": int(
            (trainer.accumulator.metrics() if trainer.accumulator else {}).get("accumulator/skipped_steps", 0)
        ),
    }


def failed_arm_result(spec: ArmSpec, error: str, *, status: str = "failed", **extra: Any) -> dict[str, Any]:
    """The result of an arm that did not finish (`status` `"failed"` or `"oom"`)."""
    return {
        "name": spec.name,
        "kind": spec.kind,
        "status": status,
        "error": error,
        "batchnorm": spec.batchnorm,
        "batchnorm_layers": 0,
        "compared_to": spec.compared_to,
        "micro_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "world_size": 1,
        "effective_batch_size": spec.effective_batch_size,
        "optimizer_steps": 0,
        "epochs": 0.0,
        "train_loss": [],
        "eval_metrics": {},
        "peak_memory_mb": None,
        "baseline_memory_mb": None,
        "memory_kind": None,
        "train_samples_per_second": None,
        "train_runtime_s": None,
        "wall_time_s": None,
        "skipped_steps": 0,
        **extra,
    }


def train_losses_from_log_history(log_history: list[dict[str, Any]]) -> list[float]:
    """
    The per-optimizer-step train loss from `Trainer.state.log_history` (entries with a `"loss"` key; run with
    `logging_steps=1` to get one per step).

    Example:

    ```python
    >>> from harness.arms import train_losses_from_log_history
    >>> train_losses_from_log_history([{"loss": 0.7, "step": 1}, {"eval_loss": 0.6, "step": 1}, {"loss": 0.5, "step": 2}])
    [0.7, 0.5]
    ```
    """
    return [float(entry["loss"]) for entry in log_history if "loss" in entry]


def write_arm_result(result: dict[str, Any], output_dir: str | Path) -> Path:
    """Write one arm's result to `arms/<arm>/arm_result.json` (read back by the parent process)."""
    path = arm_dir(output_dir, result["name"]) / ARM_RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def save_arm_weights(model: torch.nn.Module, path: str | Path) -> Path:
    """Save the trainable parameters (by name, on CPU) to compare final weights across arms."""
    from safetensors.torch import save_file

    # No copy on CPU: the arm is finished, and a copy would only add to the process's memory.
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return Path(path)


class QuietProgressCallback(ProgressCallback):
    """
    The Trainer's progress bar, with the latest train loss in the bar instead of one printed line per log. Logging
    every step (needed for the per-step parity check) would otherwise print hundreds of lines.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)


# ---------------------------------------------------------------------------------------------------- all arms
def report_parity_run(
    results: Sequence[dict[str, Any]],
    specs: Sequence[ArmSpec],
    *,
    metadata: dict[str, Any],
    parity_args: ParityArguments,
    output_dir: str | Path,
    saved_arm: str,
) -> int:
    """
    Build and write the parity report from the arms' results (rank 0 only), delete the per-arm weights unless
    `keep_arm_outputs`, and print the one-screen summary.

    Returns:
        `int`: the recipe's exit status: 1 if an arm failed (out-of-memory arms are a result, not a failure), else 0.

    Example:

    ```python
    >>> sys.exit(report_parity_run(results, specs, metadata=meta, parity_args=parity_args, output_dir="out",
    ...                            saved_arm="accumulated"))  # doctest: +SKIP
    ```
    """
    if not is_rank_zero():
        return 0  # under a multi-process launch, rank 0 writes the report
    output_dir = Path(output_dir)
    if results and all(result["status"] == "failed" for result in results):
        # A report of "did not finish" rows only would look like a result; there is none.
        print(
            f"\nEvery arm failed; no report written. Logs: {output_dir / 'arms'}/<arm>/{ARM_LOG_FILE}", file=sys.stderr
        )
        return 1
    weight_paths = {spec.name: arm_dir(output_dir, spec.name) / ARM_WEIGHTS_FILE for spec in specs}
    report = build_parity_report(
        results,
        metadata=metadata,
        loss_tolerance=parity_args.loss_tolerance,
        max_memory_mb=parity_args.max_memory_mb,
        weight_paths=weight_paths,
    )
    paths = write_parity_report(report, output_dir)
    if not parity_args.keep_arm_outputs:
        for path in weight_paths.values():
            path.unlink(missing_ok=True)
    print("\n" + format_summary(report))
    print(f"Report: {paths['markdown']}  (JSON, loss_curves.png, memory.png alongside)")
    if (output_dir / "config.json").is_file():
        print(f"Model of the {saved_arm!r} arm: {output_dir} (load with from_pretrained)")
    return 1 if any(arm["status"] == "failed" for arm in report["arms"]) else 0
