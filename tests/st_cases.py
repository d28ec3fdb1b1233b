"""Tiny offline sentence-transformers pieces: a random-init BERT `SentenceTransformer` (Transformer + mean pooling)
built from a local folder with the word-level test tokenizer, (anchor, positive) pairs, sequential batches, and one
SGD(lr=1) step through a trainer, so that a composed trainer at GA = K and the stock trainer on one batch of b x K see
the same rows in the same order."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import datasets
import torch

from tests.composition_cases import VOCAB, WORDS, word_tokenizer

B, K = 4, 3


def tiny_sentence_transformer(folder: Path, seed: int = 0, hidden: int = 16):
    """A `SentenceTransformer` (random-init 2-layer BERT, hidden 16, no dropout, mean pooling) saved under `folder`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertModel

    path = _tiny_bert_folder(folder, f"bert{seed}", BertModel, seed, hidden)
    transformer = Transformer(str(path), max_seq_length=32)
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")])


def pairs(n: int, seed: int = 5, labels: bool = False) -> datasets.Dataset:
    """(anchor, positive) pairs of 2 to 10 words; the positive shares the anchor's first words. With `labels`, a
    float `label` in [0, 1] (for score losses such as CoSENT)."""
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"anchor": [], "positive": []}
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 10))]
        rows["anchor"].append(" ".join(words))
        rows["positive"].append(" ".join(words[: max(1, len(words) // 2)] + [rng.choice(WORDS)]))
    if labels:
        rows["label"] = [rng.random() for _ in range(n)]
    return datasets.Dataset.from_dict(rows)


def sequential_batches(dataset, batch_size: int, drop_last: bool, **kwargs):
    """A `batch_sampler` for `SentenceTransformerTrainingArguments`: the dataset in order, no shuffling."""
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from torch.utils.data import SequentialSampler

    return DefaultBatchSampler(
        SequentialSampler(range(len(dataset))),
        batch_size=batch_size,
        drop_last=drop_last,
        valid_label_columns=kwargs.get("valid_label_columns"),
        generator=kwargs.get("generator"),
        seed=kwargs.get("seed", 0),
    )


def st_args(folder: Path, batch: int, steps: int, args_cls=None, **overrides):
    """One SGD(lr=1) step, no clipping, sequential batches, on CPU: the arguments every trainer of these tests uses
    (`args_cls`: the trainer's own arguments class; `SentenceTransformerTrainingArguments` by default)."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    kwargs = dict(
        output_dir=str(folder / f"out_{batch}x{steps}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=steps,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        warmup_steps=0,
        batch_sampler=sequential_batches,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    kwargs.update(overrides)
    return (args_cls or SentenceTransformerTrainingArguments)(**kwargs)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters() if p.requires_grad])


def one_step(
    trainer_cls, folder: Path, make_loss, batch: int, steps: int, dataset=None, make_model=None, **arg_overrides
):
    """Train one optimizer step of `trainer_cls` on a fresh tiny model (`make_model(folder)`, a SentenceTransformer
    by default); return (update, trainer)."""
    model = (make_model or tiny_sentence_transformer)(folder)
    before = flat(model)
    trainer = trainer_cls(
        model=model,
        args=st_args(folder, batch, steps, **arg_overrides),
        train_dataset=dataset if dataset is not None else pairs(B * K),
        loss=make_loss(model),
    )
    trainer.train()
    return flat(model) - before, trainer


def relative_difference(update: torch.Tensor, reference: torch.Tensor) -> float:
    return float((update - reference).norm() / reference.norm())


def _tiny_bert_folder(folder: Path, name: str, model_cls, seed: int, hidden: int = 16, **config) -> Path:
    """A random-init 2-layer BERT (`model_cls`, dropout off) and the word-level tokenizer, saved under `folder`."""
    from transformers import BertConfig

    path = folder / name
    if not path.exists():
        torch.manual_seed(seed)
        bert_config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=2 * hidden,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
            **config,
        )
        model_cls(bert_config).save_pretrained(path)
        word_tokenizer().save_pretrained(path)
    return path


def tiny_cross_encoder(folder: Path, seed: int = 0, initializer_range: float | None = None):
    """A `CrossEncoder` (random-init 2-layer BERT with a 1-score head, no dropout). `initializer_range` (BERT's
    default is 0.02): at 0.02 this tiny model scores every (query, document) pair almost alike, so the documents'
    score gradients are almost equal and a listwise loss's gradient cancels (ListNet: 5e3 times smaller than its
    per-pair terms, at the level of fp32 rounding); at 0.2 the scores depend on the texts and it does not cancel."""
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    name, config = f"ce{seed}", {}
    if initializer_range is not None:
        name, config = f"ce{seed}_init{initializer_range}", {"initializer_range": initializer_range}
    path = _tiny_bert_folder(folder, name, BertForSequenceClassification, seed, num_labels=1, **config)
    return CrossEncoder(str(path), num_labels=1, max_length=32)


def listwise(n: int = 12, seed: int = 0) -> datasets.Dataset:
    """(query, [2 to 4 documents], [1, 0, ...]) rows for CrossEncoder's listwise losses (ListNet, ListMLE, Lambda)."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))

    rows: dict[str, list[Any]] = {"query": [], "docs": [], "labels": []}
    for _ in range(n):
        docs = rng.randint(2, 4)
        rows["query"].append(sentence())
        rows["docs"].append([sentence() for _ in range(docs)])
        rows["labels"].append([1.0] + [0.0] * (docs - 1))
    return datasets.Dataset.from_dict(rows)


def tiny_sparse_encoder(folder: Path, seed: int = 0):
    """A SPLADE `SparseEncoder` (random-init 2-layer BERT masked-LM head, max pooling, no dropout)."""
    from sentence_transformers.sentence_transformer.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertForMaskedLM

    path = _tiny_bert_folder(folder, f"splade{seed}", BertForMaskedLM, seed)
    transformer = Transformer(str(path), max_seq_length=32, transformer_task="fill-mask")
    return SparseEncoder(modules=[transformer, SpladePooling("max")])


def tiny_multi_vector_encoder(folder: Path, seed: int = 0):
    """A `MultiVectorEncoder` (random-init 2-layer BERT, no dropout; its default token projection and masking)."""
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoder
    from transformers import BertModel

    path = _tiny_bert_folder(folder, f"bert{seed}", BertModel, seed)
    torch.manual_seed(seed)  # the default projection layer is initialised here
    return MultiVectorEncoder(str(path))
