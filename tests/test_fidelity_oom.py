"""Differential fidelity of `auto_find_batch_size=True` with real allocation failures: a piece whose memory grows with
the batch asks the CPU allocator for `rows * 2**41` bytes above 2 rows, and the allocator really fails
("DefaultCPUAllocator: can't allocate memory"), in the forward, in `optimizer.step()` and in a callback.

- Outside `training_step` (optimizer step, callback): the stock `find_executable_batch_size` restarts the loop at half
  the batch, for both trainers; same steps, logs and weights (1e-5).
- In the forward (inside `training_step`): the stock Trainer restarts at half the batch (the effective batch halves,
  twice the optimizer steps); ours shrinks the micro-batch inside the window and keeps the effective batch: the
  documented difference, checked against an unlimited stock run at the full batch (1e-5).
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from tests.fidelity_support import assert_logs_match, assert_weights_match, make, tiny_model

ROWS_THAT_FIT = 2


def allocate_for(rows: int) -> None:
    """A real allocation whose size grows with the batch: it fails above `ROWS_THAT_FIT` rows."""
    if rows > ROWS_THAT_FIT:
        torch.empty(rows << 41, dtype=torch.uint8)  # terabytes: the CPU allocator refuses


class AllocatingCallback(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        allocate_for(state.train_batch_size)


def _memory_hungry_model(where: str):
    model = tiny_model()
    seen = {"rows": 0}

    def forward_hook(module, inputs, output):
        seen["rows"] = output.shape[0]
        if where == "forward" and module.training:
            allocate_for(output.shape[0])

    model.bert.embeddings.register_forward_hook(forward_hook)
    return model, seen


def _run(side, tmp_path, where, **overrides):
    model, seen = _memory_hungry_model(where)
    callbacks = [AllocatingCallback()] if where == "callback" else None
    trainer = make(side, tmp_path, model=model, callbacks=callbacks, auto_find_batch_size=True, **overrides)
    if where == "optimizer":
        trainer.create_optimizer()
        trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: allocate_for(seen["rows"]))
    trainer.train()
    return trainer


@pytest.mark.parametrize("where", ["optimizer", pytest.param("callback", marks=pytest.mark.slow)])
def test_oom_outside_training_step_restarts_at_a_smaller_batch_like_stock(tmp_path, where):
    stock, ours = _run("stock", tmp_path, where), _run("ours", tmp_path, where)
    assert stock.state.train_batch_size == ours.state.train_batch_size == ROWS_THAT_FIT
    assert stock.state.global_step == ours.state.global_step == 8
    assert_logs_match(stock.state.log_history, ours.state.log_history)
    assert_weights_match(stock.model, ours.model)


@pytest.mark.slow  # ~40 s on a loaded 2-core machine; tests/test_oom.py covers the in-window retry by default
def test_oom_in_the_forward_keeps_the_effective_batch(tmp_path):
    stock, ours = _run("stock", tmp_path, "forward"), _run("ours", tmp_path, "forward")
    # Stock: restarted at batch 2, so 8 optimizer steps of 2 samples.
    assert (stock.state.train_batch_size, stock.state.global_step) == (2, 8)
    # Ours: the micro-batch is split inside the window: still 4 optimizer steps of 4 samples...
    assert ours.state.global_step == 4 and ours.micro_batch_chunk_size == 2
    # ... with the update of an unlimited run at batch 4.
    unlimited = make("stock", tmp_path / "unlimited")
    unlimited.train()
    assert_weights_match(unlimited.model, ours.model)
