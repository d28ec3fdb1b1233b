"""Tiny transformers models whose loss fixes its own normalisation, with a window of 12 rows each: what
`tests/test_model_losses.py` trains with `GradAccumTrainer` (4 x 3) against the stock Trainer's one batch of 12."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForPreTraining,
    BertForSequenceClassification,
    CLIPConfig,
    CLIPModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
    SiglipConfig,
    SiglipModel,
    Trainer,
    TrainingArguments,
    Wav2Vec2Config,
    Wav2Vec2ForCTC,
    YolosConfig,
    YolosForObjectDetection,
)

from hf_gradaccum import GradAccumArguments, GradAccumTrainer

ROWS, VOCAB, SEQ = 12, 64, 10
_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
)
_TEXT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=VOCAB,
             max_position_embeddings=16)  # fmt: skip


class Rows(Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def collate(rows: list[dict]) -> dict:
    """Stack tensors; keep per-row dicts (detection targets) as a list and flags (`return_loss`) as they are."""
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        out[key] = (
            torch.stack(values) if torch.is_tensor(values[0]) else values if isinstance(values[0], dict) else values[0]
        )
    return out


def _tokens(g: torch.Generator, labels: str) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:length] = 1
        row = {"input_ids": ids, "attention_mask": mask}
        if labels == "tokens":
            row["labels"] = ids.masked_fill(mask == 0, -100)
        elif labels == "class":
            row["labels"] = torch.randint(0, 3, (), generator=g)
        else:  # pre-training: masked-LM tokens and a next-sentence label per row
            row["labels"] = ids.masked_fill((mask == 0) | (torch.rand(SEQ, generator=g) > 0.4), -100)
            row["next_sentence_label"] = torch.randint(0, 2, (), generator=g)
        rows.append(row)
    return rows


def _audio(g: torch.Generator) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        length = int(torch.randint(2, 8, (1,), generator=g))
        labels = torch.full((8,), -100)
        labels[:length] = torch.randint(1, 20, (length,), generator=g)
        rows.append({"input_values": torch.randn(4000, generator=g), "labels": labels})
    return rows


def _bert(**kwargs) -> BertConfig:
    return BertConfig(vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **_SMALL, **kwargs)  # fmt: skip


def _wav2vec2(reduction: str) -> Wav2Vec2ForCTC:
    config = Wav2Vec2Config(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 5), conv_kernel=(10, 5),
                            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, ctc_loss_reduction=reduction,
                            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                            layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0, ctc_zero_infinity=True, do_stable_layer_norm=True,
                            feat_extract_norm="layer")  # fmt: skip
    return Wav2Vec2ForCTC(config)


def _contrastive(g: torch.Generator) -> list[dict]:
    return [
        {"input_ids": torch.randint(1, VOCAB, (6,), generator=g), "pixel_values": torch.randn(3, 8, 8, generator=g),
         "return_loss": True}
        for _ in range(ROWS)
    ]  # fmt: skip


def _detection(g: torch.Generator) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        n = int(torch.randint(1, 5, (1,), generator=g))
        target = {
            "class_labels": torch.randint(0, 3, (n,), generator=g),
            "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25,
        }
        rows.append({"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": target})
    return rows


# name -> (model factory, rows factory)
CASES = {
    "bert_seq_cls": (lambda: BertForSequenceClassification(_bert(num_labels=3)), lambda g: _tokens(g, "class")),
    "llama_causal_lm": (
        lambda: LlamaForCausalLM(
            LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=32, **_SMALL)
        ),
        lambda g: _tokens(g, "tokens"),
    ),
    "bert_pretraining": (lambda: BertForPreTraining(_bert()), lambda g: _tokens(g, "pretraining")),
    "wav2vec2_ctc_sum": (lambda: _wav2vec2("sum"), _audio),
    "wav2vec2_ctc_mean": (lambda: _wav2vec2("mean"), _audio),
    "clip_return_loss": (
        lambda: CLIPModel(CLIPConfig(text_config=_TEXT, vision_config=_VISION, projection_dim=8)),
        _contrastive,
    ),
    "siglip_return_loss": (lambda: SiglipModel(SiglipConfig(text_config=_TEXT, vision_config=_VISION)), _contrastive),
    "mixtral_router_loss": (
        lambda: MixtralForCausalLM(
            MixtralConfig(
                vocab_size=VOCAB,
                num_key_value_heads=2,
                max_position_embeddings=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.02,
                router_jitter_noise=0.0,
                **_SMALL,
            )
        ),  # fmt: skip
        lambda g: _tokens(g, "tokens"),
    ),
    "resnet_batchnorm": (
        lambda: ResNetForImageClassification(
            ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
        ),  # fmt: skip
        lambda g: [
            {"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.randint(0, 3, (), generator=g)}
            for _ in range(ROWS)
        ],  # fmt: skip
    ),
    "yolos_detection": (
        lambda: YolosForObjectDetection(
            YolosConfig(
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                image_size=[32, 32],
                patch_size=8,
                num_detection_tokens=5,
                num_labels=3,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),  # fmt: skip
        _detection,
    ),
}


def build(name: str) -> tuple[torch.nn.Module, list[dict]]:
    make_model, make_rows = CASES[name]
    torch.manual_seed(0)
    model = make_model()
    return model, make_rows(torch.Generator().manual_seed(1))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters() if p.requires_grad])


def one_step(model: torch.nn.Module, rows: list[dict], out: str, *, ours: bool, micro: int, steps: int, **options):
    """One SGD step (no clipping, constant rate, sequential rows) with the stock Trainer or `GradAccumTrainer`."""
    arguments = GradAccumArguments if ours else TrainingArguments
    args = arguments(
        out, per_device_train_batch_size=micro, gradient_accumulation_steps=steps, max_steps=1, optim="sgd",
        learning_rate=0.1, max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
        train_sampling_strategy="sequential", remove_unused_columns=False, report_to=[], save_strategy="no",
        use_cpu=True, logging_strategy="no", disable_tqdm=True, **options,
    )  # fmt: skip
    trainer_cls = GradAccumTrainer if ours else Trainer
    trainer_cls(model=model, args=args, train_dataset=Rows(rows), data_collator=collate).train()
