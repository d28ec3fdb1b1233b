"""What the installed torch supports, for tests of features gated on a newer torch than the package's floor."""

import pytest
import torch
from packaging.version import Version

TORCH = Version(Version(torch.__version__).base_version)
# FSDP2 accumulation makes the reduce-scatter sum with `FSDPModule.set_gradient_divide_factor`, new in torch 2.8.
FSDP2_TORCH = TORCH >= Version("2.8")
needs_fsdp2_torch = pytest.mark.skipif(
    not FSDP2_TORCH, reason=f"FSDP2 accumulation needs torch>=2.8; torch {torch.__version__} gets the refusal instead"
)


def _fsdp2_internals_for_once_per_window() -> bool:
    # The opt-in `fsdp_reduce_schedule="once_per_window"` reads FSDP2 private state: `FSDPState._fsdp_param_groups`
    # (torch 2.13) or the older single `_fsdp_param_group` (torch 2.11). Without either it is refused with a message,
    # and its tests skip.
    try:
        import inspect

        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return False
    source = inspect.getsource(FSDPState)
    return "_fsdp_param_groups" in source or "self._fsdp_param_group:" in source


needs_once_per_window_internals = pytest.mark.skipif(
    not _fsdp2_internals_for_once_per_window(),
    reason=f"fsdp_reduce_schedule='once_per_window' needs FSDP2 internals torch {torch.__version__} lacks (refused)",
)
