"""Shared pieces of the differential fidelity tests (`tests/test_fidelity_*.py`): run the same tiny script with the
stock `transformers.Trainer` and with `GradAccumTrainer` (same arguments, same seed) and compare what each does.

Tolerances: weights and logged floats 1e-5 relative (fp32; the accumulator sums in fp32 buffers and weights each
micro-batch by its items, so only the order of floating-point operations differs).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from transformers import BertForSequenceClassification, Trainer, TrainingArguments

from hf_gradaccum import GradAccumTrainer
from tests.parity_cases import flat_params, seq_cls_data, tiny_bert_config

RTOL = 1e-5
# Keys whose values are timings (never equal between two runs).
TIMING_KEYS = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
    "test_runtime",
    "test_samples_per_second",
    "test_steps_per_second",
}
TRAINERS = {"stock": Trainer, "ours": GradAccumTrainer}


def tiny_model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(num_labels=3))


def data(n: int = 16, seed: int = 1):
    return seq_cls_data(n, torch.Generator().manual_seed(seed))


def args(output_dir: str, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        num_train_epochs=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        logging_steps=1,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def make(
    which: str,
    tmp_path,
    *,
    train_n: int = 16,
    eval_n: int = 0,
    model=None,
    callbacks=None,
    optimizers=None,
    **overrides,
):
    """A `Trainer` (`which="stock"`) or `GradAccumTrainer` (`"ours"`) on the tiny model and data."""
    kwargs: dict[str, Any] = {} if optimizers is None else {"optimizers": optimizers}
    return TRAINERS[which](
        model=tiny_model() if model is None else model,
        args=args(tmp_path / which, **overrides),
        train_dataset=data(train_n),
        eval_dataset=data(eval_n, seed=2) if eval_n else None,
        callbacks=callbacks,
        **kwargs,
    )


def outcome(fn):
    """`("ok", result)` or `("error", type name, message)`: what a call did, to compare a stock call with ours."""
    try:
        return ("ok", fn())
    except Exception as error:  # noqa: BLE001 - the stock Trainer's error is the specification
        return ("error", type(error).__name__, str(error).replace("/ours", "/stock"))


def ours_only(key: str) -> bool:
    """Log keys this project adds (documented in docs/trainer_fidelity.md)."""
    return key.startswith("accumulator/") or key.startswith("oom/")


def close(a: Any, b: Any, rtol: float = RTOL) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if math.isinf(a) or math.isinf(b):
            return a == b
        return abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-7
    return a == b


def assert_logs_match(stock: list[dict], ours: list[dict], values: bool = True, rtol: float = RTOL) -> None:
    """Same entries, same keys (ours may add `accumulator/*`), same steps/epochs, and (with `values`) same values."""
    assert len(ours) == len(stock), (len(ours), len(stock), stock, ours)
    for s, o in zip(stock, ours, strict=True):
        extra = {k for k in o if k not in s}
        assert all(ours_only(k) for k in extra), extra
        assert set(s) <= set(o), set(s) - set(o)
        for key, value in s.items():
            if key in TIMING_KEYS:
                continue
            if key in ("step", "epoch") or values:
                assert close(value, o[key], rtol), (key, value, o[key], s, o)


def assert_weights_match(stock_model, our_model, rtol: float = RTOL) -> float:
    a, b = flat_params(stock_model), flat_params(our_model)
    err = float((a - b).norm() / a.norm())
    assert err <= rtol, err
    return err


def read_state(run_dir) -> dict:
    with open(os.path.join(run_dir, "trainer_state.json")) as f:
        return json.load(f)


def checkpoints(run_dir) -> list[str]:
    return sorted(e for e in os.listdir(run_dir) if e.startswith("checkpoint-"))


def relative(path: str | None) -> str | None:
    return None if path is None else os.path.basename(path)
