"""Counting a window's items with one read from the device: `count_items_in_batches` gives what
`count_items_in_batch` gives batch by batch, and `GradAccumTrainer` counts a prefetched window with one host read of
the labels' counts (on a GPU, one wait instead of one per micro-batch); a user's `count_micro_batch_items` is still
called for each micro-batch."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, count_items_in_batch, count_items_in_batches
from tests.parity_cases import tiny_bert_config

HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (`.item()`, `.tolist()`, `int(t)`, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    token_labels = torch.randint(0, 50, (3, 7), generator=g)
    token_labels[0, 4:] = -100
    token_labels[2, 1:] = -100
    return [
        {"input_ids": torch.zeros(3, 7, dtype=torch.long), "labels": token_labels},
        {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.tensor([1, -100])},
        {"input_ids": torch.zeros(5, 4, dtype=torch.long), "labels": torch.randn(5, 2, generator=g)},
        {"input_ids": torch.zeros(4, 4, dtype=torch.long)},
        {"input_ids": torch.zeros(2, 7, dtype=torch.long), "shift_labels": token_labels[:2]},
    ]


@pytest.mark.parametrize("shift_labels", [False, True])
def test_count_items_in_batches_is_count_items_in_batch_of_each(shift_labels):
    batches = _batches()
    expected = [count_items_in_batch(b, shift_labels=shift_labels) for b in batches]
    with HostReads() as reads:
        counts = count_items_in_batches(batches, shift_labels=shift_labels)
    assert counts == expected
    assert all(type(n) is int for n in counts)
    # Three batches need their labels' values (the floating labels and the unlabelled batch count rows): one read.
    assert reads.reads == 1
    # The values, worked out by hand for the unshifted case.
    if not shift_labels:
        assert counts == [4 + 7 + 1, 1, 5, 4, 4 + 7]


def _trainer(tmp_path, model, cls=GradAccumTrainer) -> GradAccumTrainer:
    args = GradAccumArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=4, use_cpu=True, report_to=[], save_strategy="no"
    )
    return cls(model=model, args=args)


def _lm_window(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    window = []
    for k in range(n):
        ids = torch.randint(0, 60, (2, 5 + k), generator=g)
        labels = ids.clone()
        labels[0, 3:] = -100
        window.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return window


def test_trainer_counts_a_prefetched_window_with_one_host_read(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    trainer = _trainer(tmp_path, model)
    window = _lm_window()
    expected = [count_items_in_batch(b, shift_labels=True) for b in window]
    assert trainer._shifts_labels()  # decided once per model, before the window
    trainer._loss_rule.window_prefetched(trainer, window)  # the first window's measurement, with reads of its own
    assert trainer._loss_rule.rule == "shifted_label_tokens"
    with HostReads() as reads:
        batches, _ = trainer.get_batch_samples(iter(window), len(window), torch.device("cpu"))
    assert batches == window
    assert reads.reads == 1
    assert trainer._window_items_local == float(sum(expected))
    assert [trainer._micro_batch_items(b) for b in window] == expected
    # A micro-batch that is not the prefetched object (a parent rebuilt it) is counted again, on its own.
    rebuilt = dict(window[0], labels=window[0]["labels"].clone())
    assert trainer._micro_batch_items(rebuilt) == expected[0]


def test_a_users_count_is_still_called_for_each_micro_batch(tmp_path):
    seen = []

    class RowsCounted(GradAccumTrainer):
        def count_micro_batch_items(self, inputs):
            seen.append(inputs)
            return int(inputs["input_ids"].shape[0]) * 10

    trainer = _trainer(tmp_path, BertForSequenceClassification(tiny_bert_config()), RowsCounted)
    window = [
        {"input_ids": torch.zeros(r, 4, dtype=torch.long), "labels": torch.zeros(r, dtype=torch.long)} for r in (2, 3)
    ]
    trainer.get_batch_samples(iter(window), 2, torch.device("cpu"))
    # Checked against the window first (on its cuts), then called once for each micro-batch.
    assert seen[-2:] == window
    assert trainer._window_items_local == 50.0
