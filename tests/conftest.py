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
