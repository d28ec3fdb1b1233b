"""Batch-size helpers that are not accumulation itself, usable without the Trainer: BatchNorm treatments
(`normalization.py`), learning-rate scaling (`lr_scaling.py`) and micro-batch planning (`planning.py`).

May import: `engine/`.
"""
