import pytest


@pytest.fixture(autouse=True)
def _sequential_order_on_transformers_4(monkeypatch):
    """On transformers 4.x (no `train_sampling_strategy`), train in dataset order, as `**SEQUENTIAL_ORDER` asks on
    5.x (see tests/ordering.py). A no-op on 5.x."""
    from tests.ordering import HAS_SAMPLING_STRATEGY, sequential_train_sampler

    if not HAS_SAMPLING_STRATEGY:
        from transformers import Trainer

        monkeypatch.setattr(Trainer, "_get_train_sampler", sequential_train_sampler)
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
    """transformers 4.x writes `ACCELERATE_MIXED_PRECISION` into `os.environ` when a TrainingArguments with bf16 or
    fp16 is built (TRL's configs default to bf16), and every later Accelerator of the process reads it: a test that
    builds such arguments would turn the next tests' fp32 runs into bf16 autocast. Each test starts from the same
    environment."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
