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
