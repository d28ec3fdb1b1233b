"""Which training precisions a device supports, probed by running them rather than by its name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16")


def supported_precisions(device: str | torch.device) -> tuple[list[str], dict[str, str]]:
    """
    The precisions `hf-gradaccum test` can check on `device`, and why each other one cannot run there.

    - `fp32`: always;
    - `bf16`: bf16 parameters and activations (the fp32 accumulation buffer is what keeps them exact): a bf16 matmul
      must run and, on CUDA, the card must support bf16 (`torch.cuda.is_bf16_supported()`);
    - `fp16`: fp32 parameters under fp16 autocast with loss scaling: autocast must produce fp16 on this device.

    Example:

    ```python
    >>> from hf_gradaccum.diagnostics.precision import supported_precisions
    >>> supported, unsupported = supported_precisions("cpu")
    >>> supported[0]
    'fp32'
    ```
    """
    device = torch.device(device)
    supported, reasons = ["fp32"], {}
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        reasons["bf16"] = "this GPU has no bf16 support (torch.cuda.is_bf16_supported() is False)"
    else:
        problem = _runs(
            lambda: (
                torch.ones(4, 4, dtype=torch.bfloat16, device=device)
                @ torch.ones(4, 4, dtype=torch.bfloat16, device=device)
            )
        )
        supported.append("bf16") if problem is None else reasons.setdefault("bf16", problem)
    problem = _runs(lambda: _autocast_matmul(device))
    supported.append("fp16") if problem is None else reasons.setdefault("fp16", problem)
    return supported, reasons


def _autocast_matmul(device: torch.device) -> None:
    with autocast(device, "fp16"):
        out = torch.ones(4, 4, device=device) @ torch.ones(4, 4, device=device)
    if out.dtype != torch.float16:
        raise RuntimeError(f"fp16 autocast produced {out.dtype}, not float16, on {device.type}")


def _runs(probe) -> str | None:
    try:
        probe()
    except Exception as error:  # noqa: BLE001 (any failure means: not on this device; the reason is reported)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """fp16 autocast for `precision="fp16"` (fp32 parameters, as the Trainer's `fp16=True`); nothing otherwise."""
    if precision != "fp16":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        yield
