"""Supervised fine-tuning with TRL's `SFTTrainer` and exact gradient accumulation, offline, in well under a minute.

The two lines that matter are marked NEW: a trainer class that puts `GradAccumTrainer` in front of `SFTTrainer`
(either order works), and `GradAccumSFTConfig = GradAccumFields + SFTConfig`, which is TRL's `SFTConfig` (all of its
defaults) plus the accumulation options. Everything else is ordinary TRL. The model is a tiny random-init Qwen2 built from a config and
the tokenizer a word-level one built from the corpus, so nothing is downloaded.

It trains twice from the same weights: micro-batches of 4 with 4 accumulation steps (GradAccumTrainer + SFTTrainer),
and one batch of 16 per step (stock SFTTrainer, no accumulation), then prints how far apart the two runs end (AdamW,
clipping, sequences of very different lengths: they should agree to ~1e-6).

    python recipes/sft_tiny.py                 # add --output_dir to keep the checkpoints
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass, fields

from harness.requirements import require_recipe_packages

# One line naming what to install (datasets from the `recipes` extra; TRL, which no extra installs), not a traceback.
require_recipe_packages(__file__, "datasets", "trl")

import datasets  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_gradaccum import GradAccumFields, GradAccumTrainer  # noqa: E402


@dataclass
class GradAccumSFTConfig(GradAccumFields, SFTConfig):  # NEW: SFTConfig's defaults plus the accumulation options
    """TRL's `SFTConfig` with the `GradAccumTrainer` options."""


# Both runs must see the same samples in each optimizer step. transformers 5.x samples in order with
# `train_sampling_strategy="sequential"`; 4.x has no such field, and its random sampler draws from the global RNG when
# iteration starts, so there the trainers take the 4.x way to a fixed order: a sequential `_get_train_sampler`.
SEQUENTIAL_ORDER = (
    {"train_sampling_strategy": "sequential"}
    if "train_sampling_strategy" in {f.name for f in fields(SFTConfig)}
    else {}
)


def in_order(trainer_cls: type) -> type:
    """`trainer_cls` itself on transformers 5.x; on 4.x, a subclass that trains on the dataset in order."""
    if SEQUENTIAL_ORDER:
        return trainer_cls

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(self.train_dataset if train_dataset is None else train_dataset)

    return type(trainer_cls.__name__, (trainer_cls,), {"_get_train_sampler": _get_train_sampler})


class GradAccumSFTTrainer(GradAccumTrainer, SFTTrainer):  # NEW: SFTTrainer with exact accumulation
    """SFTTrainer's data preparation, loss, metrics and contexts; GradAccumTrainer's accumulation."""


def corpus(n: int, seed: int = 0) -> list[str]:
    """Short sentences from a toy grammar: lengths from 3 to 12 words, so micro-batches hold very different token
    counts (the case where averaging per-micro-batch means goes wrong)."""
    rng = random.Random(seed)
    subjects, verbs, objects = (
        ["the cat", "a dog", "my friend", "the old man"],
        ["sees", "likes", "finds"],
        [
            "the ball",
            "a red box",
            "the small green house by the river",
        ],
    )
    tails = ["", "today", "every single morning", "when the sun is low"]
    return [
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}".strip()
        for _ in range(n)
    ]


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    words = sorted({w for t in texts for w in t.split()})
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)  # both runs start from the same weights
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config)


def train(trainer_cls, config_cls, output_dir: str, micro: int, steps: int, epochs: int, texts: list[str]):
    tokenizer = word_tokenizer(texts)
    args = config_cls(  # NEW (for the accumulated run): GradAccumSFTConfig = SFTConfig + accumulation options
        output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps,
        num_train_epochs=epochs,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        bf16=False,  # TRL defaults to bf16; fp32 here so that the comparison is exact on CPU
        **SEQUENTIAL_ORDER,  # both runs see the same samples in each optimizer step
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = trainer_cls(
        model=tiny_qwen2(len(tokenizer)),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--output_dir", default=None)
    cli = parser.parse_args()
    texts = corpus(cli.samples)
    with tempfile.TemporaryDirectory() as tmp:
        out = cli.output_dir or tmp
        accumulated = train(
            in_order(GradAccumSFTTrainer), GradAccumSFTConfig, f"{out}/accumulated", 4, 4, cli.epochs, texts
        )
        large = train(in_order(SFTTrainer), SFTConfig, f"{out}/large_batch", 16, 1, cli.epochs, texts)
    if not accumulated.is_world_process_zero():  # under a multi-process launch, the first process reports
        return
    losses = [h["loss"] for h in accumulated.state.log_history if "loss" in h]
    print(
        f"accumulated run (4 x 4): {accumulated.state.global_step} optimizer steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    print(f"SFT metrics kept: mean_token_accuracy {accumulated.state.log_history[-2]['mean_token_accuracy']:.3f}")
    a = torch.cat([p.detach().flatten() for p in accumulated.model.parameters()]).double()
    b = torch.cat([p.detach().flatten() for p in large.model.parameters()]).double()
    print(f"relative weight difference after {cli.epochs} epochs: {float((a - b).norm() / b.norm()):.2e}")


if __name__ == "__main__":
    main()
