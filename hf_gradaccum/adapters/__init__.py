"""Adapters from the engine to the transformers `Trainer`: `GradAccumArguments`, `GradAccumTrainer` and the pieces
that keep the Trainer's scheduler and step counters honest when a window is skipped."""

from .compat import check_transformers_version

# Refuse an untested transformers here, with the supported range in the message, before any adapter module imports a
# name that a release outside the range may not have.
check_transformers_version()
