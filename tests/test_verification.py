"""`verify_split_invariance` (issue 10): exact models pass at 1e-5 (fp32), non-exact ones fail with the right cause,
the probe leaves no trace, bad input is refused. Tiny random-init models; dropout left ON in the BERT configs so that
the probe's neutralisation of it is tested too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    ResNetConfig,
    ResNetForImageClassification,
)

from hf_gradaccum import GradientAccumulator, verify_split_invariance
from hf_gradaccum.engine.items import count_items
from hf_gradaccum.verification import tolerance_for
from tests.composition_cases import VOCAB, tiny_gpt2, tiny_llama, tiny_mixtral, tiny_t5
from tests.parity_cases import tiny_resnet_groupnorm

TOL = 1e-5  # fp32, the tolerance every exact model must meet
N, B = 3, 4  # window: N micro-batches of B rows


def bert_config(**kw) -> BertConfig:
    # Dropout left at its default 0.1: the probe must neutralise it.
    return BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, **kw,
    )  # fmt: skip


def text_window(g, *, labels="seq", n=N, b=B, varying_length=True):
    """`n` micro-batches of `b` rows, right padded, each micro-batch its own length (concatenation pads)."""
    window = []
    for k in range(n):
        length = 6 + 2 * k if varying_length else 8
        lengths = torch.randint(2, length + 1, (b,), generator=g)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (b, length), generator=g) * mask
        batch = {"input_ids": ids, "attention_mask": mask}
        if labels == "seq":
            batch["labels"] = torch.randint(0, 3, (b,), generator=g)
        elif labels == "token":
            tok = torch.randint(0, 4, (b, length), generator=g)
            batch["labels"] = tok.masked_fill((mask == 0) | (torch.rand(b, length, generator=g) < 0.3), -100)
        elif labels == "lm":
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        window.append(batch)
    return window


def image_window(g, n=N, b=B):
    return [{"pixel_values": torch.randn(b, 1, 16, 16, generator=g), "labels": torch.randint(0, 5, (b,), generator=g)}
            for _ in range(n)]  # fmt: skip


@pytest.fixture
def g():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


def assert_exact(result):
    assert result.tolerance == TOL
    assert result.passed, result.summary()
    assert result.max_rel_diff <= TOL
    assert result.diagnosis is None


# ------------------------------------------------------------------ exact models pass
def test_bert_sequence_classification_is_exact_with_the_full_batch_too(g):
    result = verify_split_invariance(
        BertForSequenceClassification(bert_config(num_labels=3)), text_window(g), include_full_batch=True
    )
    assert_exact(result)
    assert set(result.rel_diffs) == {"half", "full"}
    assert result.splits == {"window": [4, 4, 4], "half": [2, 2] * 3, "full": [12]}


def test_bert_token_classification_is_exact(g):
    assert_exact(
        verify_split_invariance(BertForTokenClassification(bert_config(num_labels=4)), text_window(g, labels="token"))
    )


def test_bert_masked_lm_is_exact(g):
    window = text_window(g, labels="token")
    for batch in window:  # MLM labels: vocabulary ids at a few positions
        batch["labels"] = torch.where(batch["labels"] >= 0, batch["input_ids"], -100)
    assert_exact(verify_split_invariance(BertForMaskedLM(bert_config()), window))


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_causal_lm_with_padding_is_exact_when_counting_shifted_labels(g, build):
    model = build()
    model.config.attention_dropout = 0.1  # Llama: a float dropout, not a module, that the probe must zero
    assert_exact(verify_split_invariance(model, text_window(g, labels="lm"), shift_labels=True))


def test_t5_is_exact(g):
    window = []
    for batch in text_window(g, labels="lm"):
        labels = torch.randint(1, VOCAB, (B, 5), generator=g)
        labels[0, 3:] = -100
        window.append({**batch, "labels": labels})
    assert_exact(verify_split_invariance(tiny_t5(), window))


def test_groupnorm_resnet_is_exact(g):
    assert_exact(verify_split_invariance(tiny_resnet_groupnorm(), image_window(g)))


def test_peft_lora_model_is_exact(g):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    result = verify_split_invariance(model, text_window(g, labels="lm"), shift_labels=True)
    assert_exact(result)


def test_user_loss_fn_that_is_an_item_mean_is_exact(g):
    def compute_loss(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"], label_smoothing=0.1)

    model = BertForSequenceClassification(bert_config(num_labels=3))
    assert_exact(verify_split_invariance(model, text_window(g), loss_fn=compute_loss))


# ------------------------------------------------------------------ non-exact models fail with the right cause
def causes(result):
    assert not result.passed, result.summary()
    assert result.diagnosis is not None and result.diagnosis.top_modules
    return {c.kind: c for c in result.diagnosis.causes}


def test_batchnorm_resnet_fails_and_names_its_batchnorm_layers(g):
    model = ResNetForImageClassification(
        ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5)
    )  # fmt: skip
    found = causes(verify_split_invariance(model, image_window(g)))
    assert set(found) == {"batchnorm"}
    bn = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert found["batchnorm"].modules == bn and "resnet.embedder.embedder.normalization" in bn
    assert "convert_batchnorm_to_groupnorm" in found["batchnorm"].fix


def test_moe_router_aux_loss_fails_with_the_router_cause(g):
    found = causes(verify_split_invariance(tiny_mixtral(), text_window(g, labels="lm"), shift_labels=True))
    assert set(found) == {"moe_router_aux_loss"}
    assert "output_router_logits=False" in found["moe_router_aux_loss"].fix


def test_moe_without_router_loss_is_exact(g):
    model = tiny_mixtral()
    model.config.output_router_logits = False
    assert_exact(verify_split_invariance(model, text_window(g, labels="lm"), shift_labels=True))


def test_sum_loss_fails_as_a_sum(g):
    def summed(model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"], reduction="sum")

    model = BertForSequenceClassification(bert_config(num_labels=3))
    found = causes(verify_split_invariance(model, text_window(g), loss_fn=summed))
    assert set(found) == {"sum_loss"}


def test_loss_averaged_over_rows_but_counted_in_tokens_fails_with_the_row_mean_cause(g):
    def per_row_mean(model, batch):  # sum of token losses / rows: a per-sequence loss, while tokens are counted
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return losses / batch["labels"].shape[0]

    model = BertForTokenClassification(bert_config(num_labels=4))
    found = causes(verify_split_invariance(model, text_window(g, labels="token"), loss_fn=per_row_mean))
    # Issue 19: a mean over rows is its own cause (`row_mean_loss`, fix: weight by rows), no longer the generic
    # `item_count_mismatch`.
    assert set(found) == {"row_mean_loss"}
    assert "averaged over rows" in found["row_mean_loss"].detail and "by rows" in found["row_mean_loss"].fix


def test_causal_lm_counted_unshifted_fails_naming_the_shifted_count(g):
    found = causes(verify_split_invariance(tiny_gpt2(), text_window(g, labels="lm"), shift_labels=False))
    assert set(found) == {"item_count_mismatch"}
    assert "labels[..., 1:]" in found["item_count_mismatch"].detail


def test_stateful_layer_is_named(g):
    model = BertForSequenceClassification(bert_config(num_labels=3))
    torch.nn.utils.spectral_norm(model.classifier)  # power iteration updates a buffer at every training forward
    found = causes(verify_split_invariance(model, text_window(g)))
    assert "stateful_layers" in found and found["stateful_layers"].modules == ["classifier"]


# ------------------------------------------------------------------ the probe leaves no trace
def test_probe_leaves_weights_optimizer_buffers_rng_and_accumulator_untouched(g):
    model = ResNetForImageClassification(
        ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1], layer_type="basic", num_labels=5,)
    )  # fmt: skip
    model.classifier.append(torch.nn.Dropout(0.5))
    window = image_window(g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = GradientAccumulator(model, 2)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(optimizer.state_dict())

    def train_window(m, opt, accumulator):
        for batch in window[:2]:
            loss = F.cross_entropy(m(pixel_values=batch["pixel_values"]).logits, batch["labels"])
            accumulator.backward(loss, num_items=count_items(batch["labels"]))
        accumulator.step(opt)
        opt.zero_grad()

    # A first step so that the optimizer has state, and a half window in flight when the probe runs.
    twin_acc = GradientAccumulator(twin, 2)
    torch.manual_seed(2)
    train_window(model, optimizer, acc)
    torch.manual_seed(2)
    train_window(twin, twin_opt, twin_acc)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counters = acc.state_dict()
    rng = torch.get_rng_state()
    opt_state = copy.deepcopy(optimizer.state_dict())
    model.eval()

    result = verify_split_invariance(model, window)
    assert not result.passed  # BatchNorm: forward passes ran in training mode and updated running stats inside

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights + BN running stats
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training and model.classifier[-1].p == 0.5
    assert repr(acc.state_dict()) == repr(counters)
    assert repr(optimizer.state_dict()) == repr(opt_state)
    # The next training step is bitwise the same as without the probe.
    torch.manual_seed(1)
    model.train(), train_window(model, optimizer, acc)
    torch.manual_seed(1)
    twin.train(), train_window(twin, twin_opt, twin_acc)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True))


# ------------------------------------------------------------------ tolerance and bad input
def test_tolerance_follows_the_dtype():
    assert tolerance_for(torch.float32) == 1e-5
    assert tolerance_for(torch.bfloat16) == 4 * torch.finfo(torch.bfloat16).eps
    assert tolerance_for(torch.float16) == 4 * torch.finfo(torch.float16).eps


def test_micro_batches_of_one_row_merge_pairs_instead(g):
    model = BertForSequenceClassification(bert_config(num_labels=3))
    result = verify_split_invariance(model, text_window(g, n=4, b=1))
    assert_exact(result)
    assert result.splits["merge"] == [2, 2] and "cannot be halved" in result.notes[0]


def test_bad_input_is_refused_naming_the_argument(g):
    model = BertForSequenceClassification(bert_config(num_labels=3))
    with pytest.raises(ValueError, match="`batches`.*cannot be split"):
        verify_split_invariance(model, text_window(g, n=1, b=1))
    with pytest.raises(ValueError, match="`batches` is empty"):
        verify_split_invariance(model, [])
    with pytest.raises(ValueError, match="`splits`"):
        verify_split_invariance(model, text_window(g), splits=("thirds",))
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(ValueError, match="`model` has no trainable parameters"):
        verify_split_invariance(frozen, text_window(g))
