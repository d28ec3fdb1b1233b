"""`hf-gradaccum env`: the versions, devices and backends this install found, as Markdown for a bug report."""

from __future__ import annotations

import platform
import sys
from typing import Any

from ..versions import TESTED, installed_version, range_status

PACKAGES = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "sentence-transformers")


def collect_environment() -> dict[str, Any]:
    """
    The facts `hf-gradaccum env` prints: Python, package versions (with where each stands against the tested range),
    torch's CUDA/cuDNN/NCCL builds, the devices and their bf16/fp16 support, the distributed backends, and the
    distributed engines `GradAccumTrainer` runs under that this install has (docs/engines.md).

    Example:

    ```python
    >>> from hf_gradaccum.diagnostics.environment import collect_environment
    >>> sorted(collect_environment())[:3]
    ['backends', 'devices', 'engines']
    ```
    """
    import torch

    from .. import __version__
    from .precision import supported_precisions

    packages = {}
    for name in PACKAGES:
        version = installed_version(name)
        packages[name] = {
            "version": version,
            "status": range_status(name, version) if name in TESTED else ("installed" if version else "not installed"),
        }
    devices = [{"name": "cpu", "detail": platform.processor() or platform.machine(), **_precisions("cpu")}]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "name": f"cuda:{index}",
                    "detail": f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute {props.major}.{props.minor}",
                    **_precisions(f"cuda:{index}", supported_precisions),
                }
            )
    for kind in ("mps", "xpu"):
        backend = getattr(torch.backends, kind, None) if kind == "mps" else getattr(torch, kind, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            devices.append({"name": kind, "detail": "", **_precisions(kind, supported_precisions)})
    distributed = torch.distributed.is_available()
    return {
        "hf_gradaccum": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": packages,
        "torch_build": {
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "nccl": _nccl_version(),
            "hip": getattr(torch.version, "hip", None),
        },
        "devices": devices,
        "backends": {name: distributed and _backend_available(name) for name in ("gloo", "nccl", "mpi", "xccl")},
        "engines": installed_engines(),
    }


def installed_engines() -> dict[str, str | None]:
    """
    The distributed engines `GradAccumTrainer` runs under, each with what this install has of it: "DDP" and "FSDP2"
    (`fully_shard`) come with torch.distributed; "DeepSpeed" is its version, or `None` when not installed (read from
    the package metadata: importing DeepSpeed would probe the accelerators).

    Example:

    ```python
    >>> from hf_gradaccum.diagnostics.environment import installed_engines
    >>> sorted(installed_engines())
    ['DDP', 'DeepSpeed', 'FSDP2']
    ```
    """
    import importlib.util

    import torch

    distributed = torch.distributed.is_available()
    fsdp2 = distributed and importlib.util.find_spec("torch.distributed.fsdp") is not None
    if fsdp2:
        import torch.distributed.fsdp as fsdp

        fsdp2 = hasattr(fsdp, "fully_shard")
    return {
        "DDP": "torch.distributed" if distributed else None,
        "FSDP2": "torch.distributed.fsdp.fully_shard" if fsdp2 else None,
        "DeepSpeed": installed_version("deepspeed"),
    }


def _precisions(device: str, probe=None) -> dict[str, Any]:
    from .precision import supported_precisions

    supported, reasons = (probe or supported_precisions)(device)
    return {"precisions": supported, "unsupported": reasons}


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 (a CPU build has no NCCL; only the report line changes)
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else (str(version) if version else None)


def _backend_available(name: str) -> bool:
    import torch.distributed as dist

    check = getattr(dist, f"is_{name}_available", None)
    return bool(check()) if callable(check) else False


def format_environment(env: dict[str, Any]) -> str:
    """`collect_environment()` as Markdown (paste it into a bug report)."""
    lines = ["## hf_gradaccum environment", "", f"- hf_gradaccum: {env['hf_gradaccum']}"]
    lines += [f"- Python: {env['python']}", f"- Platform: {env['platform']}", "", "| package | version | range |"]
    lines.append("|---|---|---|")
    for name, info in env["packages"].items():
        lines.append(f"| {name} | {info['version'] or '-'} | {info['status']} |")
    build = env["torch_build"]
    lines += ["", f"- torch build: CUDA {build['cuda'] or '-'}, cuDNN {build['cudnn'] or '-'}, "
              f"NCCL {build['nccl'] or '-'}" + (f", HIP {build['hip']}" if build["hip"] else "")]  # fmt: skip
    backends = ", ".join(name for name, ok in env["backends"].items() if ok) or "none"
    engines = ", ".join(f"{name} {have}" if name == "DeepSpeed" and have else (name if have else f"{name} not installed")
                        for name, have in env.get("engines", {}).items())  # fmt: skip
    lines += [f"- Distributed backends: {backends}", f"- Engines: {engines or '-'}"]
    lines += ["", "| device | detail | precisions | not supported |"]
    lines.append("|---|---|---|---|")
    for device in env["devices"]:
        unsupported = "; ".join(f"{p}: {why}" for p, why in device["unsupported"].items()) or "-"
        lines.append(f"| {device['name']} | {device['detail']} | {', '.join(device['precisions'])} | {unsupported} |")
    tested = ", ".join(f"{name} {r.oldest}..{r.newest}" for name, r in TESTED.items())
    lines += ["", f"Tested: {tested}. torch, transformers and accelerate older than the first are refused; any package "
              "newer than the second gets one warning and is used. trl and peft are optional (the test extras)."]  # fmt: skip
    return "\n".join(lines)
