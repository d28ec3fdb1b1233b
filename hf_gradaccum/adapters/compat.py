"""Private transformers details, isolated here so the rest of the package uses the public contract only."""

from __future__ import annotations

from typing import Any

# --- helper A ---


def rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Delete old checkpoints in `run_dir` as the stock Trainer does after a save (`save_total_limit`, keeping the
    best one). transformers >= 5.x has a module-level `rotate_checkpoints`; 4.x a `Trainer._rotate_checkpoints`."""
    try:
        from transformers.trainer_utils import rotate_checkpoints as rotate
    except ImportError:  # transformers 4.x
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        return
    rotate(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )
