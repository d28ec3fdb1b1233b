"""`verify_split_invariance` on first contact (issue 19): never wrong (randomness beyond nn.Dropout neutralised, every
RNG restored, a random forward is "cannot decide", never "not exact"), never crashes on a model that trains
(BatchNorm with 2-3 row micro-batches, a forward that raises), and diagnoses that do not depend on a lucky split.

Tiny plain-torch models (a few hundred parameters), so each test takes well under a second or two; the Wav2Vec2
cases run the real transformers model with `layerdrop`, SpecAugment masking (numpy RNG) and CTC."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from hf_gradaccum import verify_split_invariance

VOCAB, HIDDEN, CLASSES = 11, 8, 3


def token_window(g: torch.Generator, lengths_per_batch: list[list[int]], width: int = 7) -> list[dict]:
    """One micro-batch per entry of `lengths_per_batch`: rows of those many labelled tokens, right padded."""
    window = []
    for lengths in lengths_per_batch:
        lengths = torch.tensor(lengths)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g) * mask
        labels = torch.randint(0, CLASSES, (len(lengths), width), generator=g).masked_fill(mask == 0, -100)
        window.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return window


class DropPath(nn.Module):
    """timm's DropPath, reproduced: a per-sample residual drop, random in training mode (found by its name)."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = (torch.rand(x.shape[0], 1, 1) >= self.drop_prob).to(x.dtype)
        return x * keep / (1 - self.drop_prob)


class StochasticTagger(nn.Module):
    """A token tagger with the randomness of speech encoders: LayerDrop read from its config at forward time
    (Python's `random`, as in several HF encoders), SpecAugment-style time masking drawn from numpy's global RNG
    (as Wav2Vec2's `_compute_mask_indices`), stochastic depth (DropPath) and a float attention-dropout attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig(layerdrop=0.5, mask_time_prob=0.3, drop_path_rate=0.3)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.drop_path = DropPath(self.config.drop_path_rate)
        self.attention_dropout = 0.2  # a float read at forward time (Llama style)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, input_ids, attention_mask, labels):
        x = self.embed(input_ids)
        if self.training and self.config.mask_time_prob > 0:
            masked = np.random.rand(*input_ids.shape) < self.config.mask_time_prob
            x = x.masked_fill(torch.from_numpy(masked)[..., None], 0.0)
        for layer in self.layers:
            if self.training and random.random() < self.config.layerdrop:
                continue
            x = x + self.drop_path(torch.tanh(layer(x)))
        x = F.dropout(x, self.attention_dropout, self.training)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "config": model.config.to_dict() if hasattr(model, "config") else None,
        "modes": [m.training for m in model.modules()],
        "attrs": [dict((k, v) for k, v in vars(m).items() if isinstance(v, float)) for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    assert after["config"] == before["config"]
    assert after["modes"] == before["modes"]
    assert after["attrs"] == before["attrs"]


@pytest.fixture
def g() -> torch.Generator:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    return torch.Generator().manual_seed(0)


# ------------------------------------------------------------------ 1. never wrong
def test_layer_drop_numpy_masking_and_drop_path_are_neutralised_and_every_rng_is_left_as_it_was(g):
    model = StochasticTagger()
    window = token_window(g, [[7, 5, 3, 6], [4, 7, 2, 5], [6, 6, 3, 7]])
    # The model *is* random in training (otherwise this test proves nothing), and draws from all three RNGs.
    numpy_state, python_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    with torch.no_grad():
        losses = {float(model(**window[0])) for _ in range(4)}
    assert len(losses) > 1
    assert not np.array_equal(np.random.get_state()[1], numpy_state[1]) and random.getstate() != python_state
    model.eval()
    before = snapshot(model)
    numpy_state, python_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()

    result = verify_split_invariance(model, window)

    assert result.verdict == "exact" and result.passed, result.summary()
    assert result.max_rel_diff <= 1e-5 and result.diagnosis is None
    assert {"config.layerdrop=0.5", "config.mask_time_prob=0.3", "config.drop_path_rate=0.3"} <= set(
        result.neutralised
    )
    assert "drop_path (DropPath)" in result.neutralised and "<root>.attention_dropout=0.2" in result.neutralised
    # Numpy's global RNG (and Python's, torch's) not advanced by the probe; the model exactly as it was.
    after_numpy = np.random.get_state()
    assert np.array_equal(after_numpy[1], numpy_state[1]) and after_numpy[2:] == numpy_state[2:]
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)
    assert_unchanged(model, before)
    assert model.config.layerdrop == 0.5 and model.drop_path.drop_prob == 0.3 and not model.training


class NoisyTagger(StochasticTagger):
    """Randomness no switch controls: noise added to the hidden states at every forward (numpy or torch)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def forward(self, input_ids, attention_mask, labels):
        x = self.embed(input_ids)
        if self.source == "numpy":
            noise = torch.from_numpy(np.random.randn(*x.shape).astype("float32"))
        elif self.source == "python":
            noise = torch.full_like(x, random.gauss(0.0, 1.0))
        else:
            noise = torch.randn_like(x)
        logits = self.head(torch.tanh(self.layers[0](x + 0.3 * noise)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize(
    "source,named", [("numpy", "numpy global RNG"), ("torch", "torch CPU RNG"), ("python", "Python `random`")]
)
def test_a_forward_that_stays_random_is_cannot_decide_naming_the_rng(g, source, named):
    model = NoisyTagger(source)
    window = token_window(g, [[7, 5, 3, 6], [4, 7, 2, 5]])
    numpy_state, python_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    result = verify_split_invariance(model, window)
    assert result.verdict == "cannot_decide" and not result.passed, result.summary()
    assert result.rel_diffs["repeat"] > 1e-5  # the window computed twice differs
    assert any(named in reason for reason in result.why), result.why
    kinds = [c.kind for c in result.diagnosis.causes]
    assert kinds == ["nondeterministic_forward"]
    assert "CANNOT DECIDE" in result.summary()
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)


# ------------------------------------------------------------------ 2. never crash on a model that trains
class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, CLASSES))

    def forward(self, x, labels):
        return F.cross_entropy(self.net(x), labels)


@pytest.mark.parametrize("sizes", [[2, 3], [2, 2, 2], [3, 3], [3]], ids=["2+3", "2x3", "3+3", "one-of-3"])
def test_batchnorm1d_with_micro_batches_of_2_and_3_rows_gives_a_verdict(g, sizes):
    model = BatchNormNet()
    window = [{"x": torch.randn(n, 4, generator=g), "labels": torch.randint(0, CLASSES, (n,), generator=g)}
              for n in sizes]  # fmt: skip
    # The user's loop trains on these micro-batches: BatchNorm1d needs 2 rows, and each has 2 or 3.
    for batch in window:
        model(**batch).backward()
    model.zero_grad()
    before = snapshot(model)
    result = verify_split_invariance(model, window)
    assert result.verdict == "not_exact", result.summary()
    assert [c.kind for c in result.diagnosis.causes] == ["batchnorm"]
    assert result.diagnosis.causes[0].modules == ["net.1"]
    assert all(min(split) >= 2 for split in result.splits.values())
    if len(sizes) == 1:  # nothing to split into parts of 2 rows: settled by inspection, without a forward
        assert result.rel_diffs == {} and "inspecting" in result.notes[-1]
        assert result.to_dict()["max_rel_diff"] is None and "NOT EXACT" in result.summary()
    else:
        assert result.max_rel_diff > 1e-3 and "merge" in result.splits
    assert_unchanged(model, before)


class ShapeFussyNet(nn.Module):
    """Trains on its own micro-batches of 4 rows, and raises on anything smaller."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, CLASSES)

    def forward(self, x, labels):
        if x.shape[0] < 4:
            raise RuntimeError(f"this model needs micro-batches of 4 rows, got {x.shape[0]}")
        return F.cross_entropy(self.linear(x), labels)


def test_a_forward_that_raises_on_a_split_is_cannot_decide_with_the_message_and_where(g):
    model = ShapeFussyNet().eval()
    window = [{"x": torch.randn(4, 4, generator=g), "labels": torch.randint(0, CLASSES, (4,), generator=g)}
              for _ in range(2)]  # fmt: skip
    before = snapshot(model)
    result = verify_split_invariance(model, window)
    assert result.verdict == "cannot_decide" and not result.passed
    (why,) = result.why
    assert "'half' split" in why and "RuntimeError: this model needs micro-batches of 4 rows, got 2" in why
    assert "in forward" in why and "test_verification_robustness.py" in why  # where it was raised
    assert_unchanged(model, before)


def test_a_forward_that_raises_on_the_window_itself_is_cannot_decide(g):
    model = ShapeFussyNet()
    window = [{"x": torch.randn(2, 4, generator=g), "labels": torch.randint(0, CLASSES, (2,), generator=g)}
              for _ in range(2)]  # fmt: skip
    result = verify_split_invariance(model, window)
    assert result.verdict == "cannot_decide" and "'window' split" in result.why[0] and "got 2" in result.why[0]


# ------------------------------------------------------------------ 3. diagnoses that do not depend on luck
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def logits(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)))


def per_row_normalised_loss(model, batch):
    """Each row's token losses averaged over the row's tokens, then the rows averaged (CTC `reduction="mean"`)."""
    labels = batch["labels"]
    token = F.cross_entropy(model.logits(batch["input_ids"]).transpose(1, 2), labels, reduction="none")
    valid = (labels != -100).float()
    return ((token * valid).sum(1) / valid.sum(1)).mean()


def test_per_row_normalised_loss_is_diagnosed_even_when_the_halves_hold_equal_token_counts(g):
    # The first micro-batch's halves hold 8 and 8 tokens (the old probe cut there and could not tell rows from
    # tokens); the others differ, so accumulation weighted by tokens is not exact.
    window = token_window(g, [[3, 5, 5, 3], [7, 2, 6, 1], [2, 7, 4, 4]])
    result = verify_split_invariance(Tagger(), window, loss_fn=per_row_normalised_loss)
    assert result.verdict == "not_exact", result.summary()
    causes = {c.kind: c for c in result.diagnosis.causes}
    assert set(causes) == {"row_mean_loss"}
    assert "CTC" in causes["row_mean_loss"].detail and "weight micro-batches by rows" in causes["row_mean_loss"].fix
    # The fix works: counting one item per row makes it exact.
    fixed = verify_split_invariance(
        Tagger(), window, loss_fn=per_row_normalised_loss, count_items=lambda b: b["labels"].shape[0]
    )
    assert fixed.verdict == "exact", fixed.summary()


class RunningCentre(nn.Module):
    """A running-statistics layer (not BatchNorm): centres by an exponential mean of past inputs, updated in
    training. Per-row given its state, but its state changes at every forward."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(size))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.5).add_(0.5 * x.detach().flatten(0, -2).mean(0))
        return x - self.running_mean


class StatefulTagger(Tagger):
    def __init__(self) -> None:
        super().__init__()
        self.centre = RunningCentre(HIDDEN)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.head(self.centre(torch.tanh(self.embed(input_ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_stateful_layer_is_the_only_cause(g):
    model = StatefulTagger()
    before = snapshot(model)
    result = verify_split_invariance(model, token_window(g, [[7, 5, 3, 6], [4, 7, 2, 5], [6, 6, 3, 7]]))
    assert result.verdict == "not_exact", result.summary()
    assert result.rel_diffs["repeat"] == 0.0  # each split starts from the same state: deterministic
    assert [c.kind for c in result.diagnosis.causes] == ["stateful_layers"]
    assert result.diagnosis.causes[0].modules == ["centre"]
    assert_unchanged(model, before)


def test_spectral_norm_is_named_without_a_spurious_cause(g):
    model = Tagger()
    model.forward = lambda input_ids, attention_mask, labels: F.cross_entropy(
        model.logits(input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100
    )
    nn.utils.spectral_norm(model.head)
    result = verify_split_invariance(model, token_window(g, [[7, 5, 3, 6], [4, 7, 2, 5]]))
    assert result.verdict == "not_exact", result.summary()
    assert [c.kind for c in result.diagnosis.causes] == ["stateful_layers"]


def test_causes_table_is_one_entry_per_kind():
    from hf_gradaccum.verification.diagnosis import FIXES

    assert {"batchnorm", "row_mean_loss", "item_count_mismatch", "nondeterministic_forward"} <= set(FIXES)


# ------------------------------------------------------------------ real transformers: Wav2Vec2 with CTC
def tiny_wav2vec2(**kw):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=6, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, layerdrop=0.5, mask_time_prob=0.5, mask_time_length=2,
        mask_feature_prob=0.3, mask_feature_length=2, pad_token_id=0, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return Wav2Vec2ForCTC(config)


def speech_window(g, label_lengths):
    window = []
    for lengths in label_lengths:
        labels = torch.randint(1, 6, (len(lengths), max(lengths)), generator=g)
        labels = labels.masked_fill(torch.arange(max(lengths))[None] >= torch.tensor(lengths)[:, None], -100)
        window.append({"input_values": torch.randn(len(lengths), 400, generator=g), "labels": labels})
    return window


def test_wav2vec2_with_layerdrop_and_specaugment_mean_ctc_is_a_row_mean_and_exact_counted_by_rows(g):
    # CTC `reduction="mean"`: each row's loss divided by its target length, then averaged over rows.
    model = tiny_wav2vec2(ctc_loss_reduction="mean")
    window = speech_window(g, [[3, 2, 4], [2, 4, 1]])
    numpy_state = np.random.get_state()
    before = snapshot(model)
    result = verify_split_invariance(model, window)
    assert result.verdict == "not_exact", result.summary()
    assert {c.kind for c in result.diagnosis.causes} == {"row_mean_loss"}
    fixed = verify_split_invariance(model, window, count_items=lambda b: b["labels"].shape[0])
    assert fixed.verdict == "exact", fixed.summary()
    assert "config.layerdrop=0.5" in fixed.neutralised and "config.mask_time_prob=0.5" in fixed.neutralised
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])
    assert_unchanged(model, before)


@pytest.mark.slow
def test_wav2vec2_sum_ctc_counted_in_tokens_is_a_sum_loss(g):
    model = tiny_wav2vec2(ctc_loss_reduction="sum")
    result = verify_split_invariance(model, speech_window(g, [[3, 2, 4], [2, 4, 1]]))
    assert result.verdict == "not_exact" and {c.kind for c in result.diagnosis.causes} == {"sum_loss"}


class CallCounter(Tagger):
    """Deterministic but not stateless: a plain attribute (not a buffer the probe can reset) changes every forward."""

    calls = 0

    def forward(self, input_ids, attention_mask, labels):
        self.calls += 1
        logits = self.head(torch.tanh(self.embed(input_ids)) * (1 + 0.1 * self.calls))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_state_outside_buffers_is_cannot_decide_without_blaming_an_rng(g):
    result = verify_split_invariance(CallCounter(), token_window(g, [[7, 5, 3, 6], [4, 7, 2, 5]]))
    assert result.verdict == "cannot_decide", result.summary()
    assert "no random generator advanced" in result.why[0]
