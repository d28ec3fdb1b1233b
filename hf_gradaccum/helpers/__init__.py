"""Batch-size helpers that are not accumulation itself: BatchNorm treatments (`normalization`), learning-rate
scaling (`lr_scaling`) and micro-batch planning (`planning`)."""
