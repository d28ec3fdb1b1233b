"""Proving that gradient accumulation is exact for a given model, loss and item counting.

May import `engine` and `helpers` only (see tests/test_layout.py).
"""

from .diagnosis import Cause, Diagnosis
from .split_invariance import SplitInvarianceResult, tolerance_for, verify_split_invariance

__all__ = ["Cause", "Diagnosis", "SplitInvarianceResult", "tolerance_for", "verify_split_invariance"]
