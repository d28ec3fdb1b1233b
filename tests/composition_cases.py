"""Tiny offline pieces for the composition tests: a word-level tokenizer, tiny random-init causal LMs (Llama, Qwen2,
GPT-2, a Mixtral MoE) and T5, text datasets with very different lengths, and the hand-computed large-batch step.

The reference is one SGD(lr=1) step per window on the window's samples as one padded batch through the model's own
loss (a mean over the window's items), computed by hand: the update the trainers must reproduce.
"""

from __future__ import annotations

import copy
import random

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from tests.ordering import SEQUENTIAL_ORDER

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `WORDS` (no files, no network)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


VOCAB = len(SPECIAL) + len(WORDS)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def text_dataset(n: int, seed: int = 1) -> datasets.Dataset:
    """Plain-text rows of 2 to 14 words: micro-batches hold very different token counts."""
    rng = random.Random(seed)
    return datasets.Dataset.from_dict({"text": [_sentence(rng, 2, 14) for _ in range(n)]})


def prompt_completion_dataset(n: int, seed: int = 2) -> datasets.Dataset:
    rng = random.Random(seed)
    return datasets.Dataset.from_dict(
        {"prompt": [_sentence(rng, 1, 8) for _ in range(n)], "completion": [_sentence(rng, 1, 6) for _ in range(n)]}
    )


def seq2seq_dataset(n: int, tokenizer, seed: int = 3) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        src = tokenizer(_sentence(rng, 2, 10))
        rows["input_ids"].append(src["input_ids"])
        rows["attention_mask"].append(src["attention_mask"])
        rows["labels"].append(tokenizer(_sentence(rng, 1, 7))["input_ids"])
    return datasets.Dataset.from_dict(rows)


_SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, **_SMALL))


def tiny_qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, **_SMALL))


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    config.pad_token_id = 0
    return GPT2LMHeadModel(config)


def tiny_mixtral(router_aux_loss_coef: float = 0.5) -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=router_aux_loss_coef,
        router_jitter_noise=0.0,
        **_SMALL,
    )
    return MixtralForCausalLM(config)


def tiny_t5() -> T5ForConditionalGeneration:
    config = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=3,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def pad_cat(batches: list[dict[str, torch.Tensor]], pad_ids: dict[str, int]) -> dict[str, torch.Tensor]:
    """Concatenate collated micro-batches into one batch, right-padding every 2-D tensor to the longest."""
    out = {}
    for key in batches[0]:
        tensors = [b[key] for b in batches]
        if tensors[0].dim() >= 2:
            width = max(t.shape[1] for t in tensors)
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_ids.get(key, 0)) for t in tensors]
        out[key] = torch.cat(tensors)
    return out


def flat_trainable(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters() if p.requires_grad])


def sgd_reference(model: torch.nn.Module, windows: list[dict[str, torch.Tensor]], loss_fn) -> torch.nn.Module:
    """One SGD(lr=1) step per window on the whole window as one batch: `loss_fn(model, batch)` is its loss."""
    model = copy.deepcopy(model)
    model.train()
    for batch in windows:
        model.zero_grad()
        loss_fn(model, batch).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.grad is not None:
                    p -= p.grad
    return model


def relative_error(before: torch.nn.Module, after: torch.nn.Module, reference: torch.nn.Module) -> float:
    w0 = flat_trainable(before)
    d, d_ref = flat_trainable(after) - w0, flat_trainable(reference) - w0
    return float((d - d_ref).norm() / d_ref.norm())


TRAIN_ARGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    learning_rate=1.0,
    optim="sgd",
    lr_scheduler_type="constant",
    max_grad_norm=0.0,
    weight_decay=0.0,
    num_train_epochs=1,
    **SEQUENTIAL_ORDER,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
)
# 22 samples in micro-batches of 4, 4 per window: windows [4, 4, 4, 4] and [4, 2] (uneven, and a partial window).
NUM_SAMPLES = 22


def train_and_collect(trainer_cls, args, **trainer_kwargs):
    """Build the trainer, record the micro-batches it will see (sequential order) and its initial trainable weights,
    train one epoch; return (trainer, windows of collated micro-batches, initial trainable weights)."""
    trainer = trainer_cls(args=args, **trainer_kwargs)
    batches = list(trainer.get_train_dataloader())
    steps = args.gradient_accumulation_steps
    windows = [batches[i : i + steps] for i in range(0, len(batches), steps)]
    initial = flat_trainable(trainer.model)
    start = reference_copy(trainer.model)
    trainer.train()
    return trainer, windows, initial, start


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy to compute the reference with. TRL patches `forward` on the instance (its fused LM head), with a
    closure over the original model; the copy gets its class's own `forward` back so it runs its own weights."""
    model = copy.deepcopy(model)
    for module in model.modules():
        module.__dict__.pop("forward", None)
    return model


def update_error(initial: torch.Tensor, trained: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Relative error of the update `trained - initial` against `reference - initial` (trainable weights)."""
    d, d_ref = flat_trainable(trained) - initial, flat_trainable(reference) - initial
    return float((d - d_ref).norm() / d_ref.norm())


PAD = {"labels": -100}


def causal_lm_window_loss(model: torch.nn.Module, window: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The model's own loss on the window as one right-padded batch: a mean over all of the window's items."""
    batch = pad_cat([{k: v for k, v in b.items() if torch.is_tensor(v)} for b in window], PAD)
    return model(**batch, output_router_logits=False).loss if _is_moe(model) else model(**batch).loss


def _is_moe(model) -> bool:
    return hasattr(getattr(model, "config", None), "output_router_logits")


def moe_window_loss(model: torch.nn.Module, window: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The documented semantics for a per-batch statistic: the window's cross-entropy over all its tokens (exact
    large batch) plus `coef * sum_k (n_k / N) * aux_k`, each micro-batch's router loss weighted by its share of the
    window's items, as every other part of that micro-batch's loss is."""
    ce = causal_lm_window_loss(model, window)
    counts = [int(b["labels"][..., 1:].ne(-100).sum()) for b in window]
    total = sum(counts)
    aux = sum(
        n / total * model(**{k: v for k, v in b.items() if k != "labels"}, output_router_logits=True).aux_loss
        for n, b in zip(counts, window, strict=True)
    )
    return ce + model.config.router_aux_loss_coef * aux
