"""The self-test's built-in models and data: tiny random-init transformers models (nothing is downloaded) and one
window of uneven micro-batches (different row counts, and different label counts per row)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ_LEN = 64, 10
# Rows per micro-batch: uneven, so that equal weighting of micro-batches would be visibly wrong. The second is one
# row with one counted label: its per-item gradient is the largest, which the fp16 overflow check relies on.
ROWS = (3, 1, 4)
MODELS = ("causal-lm", "classifier")


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    """A 2-layer Llama causal LM (`"causal-lm"`) or a 2-layer BERT with a 3-class head (`"classifier"`), fp32,
    without dropout (so that a window and its large batch see the same function)."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "causal-lm":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ_LEN)  # fmt: skip
        return LlamaForCausalLM(config)
    if kind == "classifier":
        config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=2 * SEQ_LEN, num_labels=3,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        return BertForSequenceClassification(config)
    raise ValueError(f"`kind` must be one of {MODELS}, got {kind!r}.")


def tiny_window(kind: str, device: torch.device, rows: tuple[int, ...] = ROWS, seed: int = 1) -> list[dict]:
    """One window: a micro-batch per entry of `rows`. Causal-LM rows have between 1 and `SEQ_LEN - 1` counted
    (shifted) labels, the rest `-100`; the one-row micro-batch has exactly one. Every token is attended, so the
    micro-batches concatenate into the large batch exactly."""
    g = torch.Generator().manual_seed(seed)
    window = []
    for n in rows:
        ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if kind == "causal-lm":
            labels = ids.clone()
            for r in range(n):
                keep = 2 if n == 1 else int(torch.randint(2, SEQ_LEN + 1, (1,), generator=g))
                labels[r, keep:] = -100  # `keep` labels, `keep - 1` of them counted after the shift
            batch["labels"] = labels
        else:
            batch["labels"] = torch.randint(0, 3, (n,), generator=g)
        window.append({key: value.to(device) for key, value in batch.items()})
    return window


def concatenate(window: list[dict]) -> dict:
    """The window's micro-batches as the one large batch."""
    return {key: torch.cat([batch[key] for batch in window]) for key in window[0]}
