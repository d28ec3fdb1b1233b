"""Proving that gradient accumulation is exact for a given model, loss and item counting: the split-invariance check
(`split_invariance.py`), what it blames when a window disagrees (`diagnosis.py`), and its tools (`windows.py` cuts
and joins micro-batches, `gradients.py`, `isolation.py`, `float64.py`).

May import: `engine/`.
"""

from .diagnosis import Cause, Diagnosis
from .split_invariance import SplitInvarianceResult, tolerance_for, verify_split_invariance

__all__ = ["Cause", "Diagnosis", "SplitInvarianceResult", "tolerance_for", "verify_split_invariance"]
