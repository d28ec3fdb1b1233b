"""The error every composition refusal raises, in a module of its own so that the feature slices the registry reads
(`integrations/trl/grpo.py`, ...) can raise it without importing the registry."""

from __future__ import annotations

__all__ = ["CompositionError"]


class CompositionError(ValueError):
    """A composed trainer and loss that `GradAccumTrainer` cannot accumulate exactly (or could not show exact)."""
