"""Adapters from the engine to the transformers `Trainer`: `GradAccumArguments`, `GradAccumTrainer` and the pieces
that keep the Trainer's scheduler and step counters honest when a window is skipped."""
