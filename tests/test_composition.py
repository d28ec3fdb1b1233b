"""GradAccumTrainer composed with the trainers people already use (TRL's SFTTrainer and RewardTrainer,
transformers' Seq2SeqTrainer, PEFT LoRA models), in either class order, against the hand-computed large-batch step:
one SGD(lr=1) step per window on the window's samples as one batch. fp32, dropout off, 22 samples in micro-batches
of 4 with 4 per window (windows of 4+4+4+4 and 4+2 micro-batches of different token counts). Tolerance 1e-5 relative.

`COMBINATIONS` is shared with the slow `test_composition_error_table`, which also runs the stock trainers and prints
the table of measured errors (`pytest tests/test_composition.py -m slow -s -k table`).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    DataCollatorForSeq2Seq,
    LlamaConfig,
    LlamaForSequenceClassification,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
)
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from tests.composed_arguments import (  # noqa: E402
    GradAccumDPOConfig,
    GradAccumRewardConfig,
    GradAccumSeq2SeqArguments,
    GradAccumSFTConfig,
)
from tests.composition_cases import (  # noqa: E402
    NUM_SAMPLES,
    TRAIN_ARGS,
    VOCAB,
    WORDS,
    causal_lm_window_loss,
    moe_window_loss,
    pad_cat,
    prompt_completion_dataset,
    seq2seq_dataset,
    sgd_reference,
    text_dataset,
    tiny_gpt2,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen2,
    tiny_t5,
    train_and_collect,
    update_error,
    word_tokenizer,
)

RTOL = 1e-5


class GradAccumSeq2SeqTrainer(GradAccumTrainer, Seq2SeqTrainer):
    pass


class GradAccumDPOTrainer(GradAccumTrainer, DPOTrainer):
    pass


class GradAccumRewardTrainer(GradAccumTrainer, RewardTrainer):
    pass


class GradAccumFirstSFT(GradAccumTrainer, SFTTrainer):
    pass


class SFTFirstGradAccum(SFTTrainer, GradAccumTrainer):
    pass


SFT_ORDERS = {"gradaccum_first": GradAccumFirstSFT, "sft_first": SFTFirstGradAccum}


def _lora(targets, task="CAUSAL_LM") -> LoraConfig:
    # init_lora_weights=False: B is random too, so both LoRA matrices get a gradient on the first step.
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, task_type=task
    )


# ---------------------------------------------------------------------------------------------------------- runners
def run_sft(trainer_cls, tmp, *, data="text", peft=False, model_fn=tiny_llama, stock=False, **options) -> float:
    torch.manual_seed(0)
    args_cls = SFTConfig if stock else GradAccumSFTConfig
    extra = {"completion_only_loss": True} if data == "completion_only" else {}
    args = args_cls(str(tmp), bf16=False, **extra, **({} if stock else options), **TRAIN_ARGS)
    dataset = prompt_completion_dataset(NUM_SAMPLES) if data == "completion_only" else text_dataset(NUM_SAMPLES)
    kwargs = {"peft_config": _lora(["q_proj", "v_proj"])} if peft else {}
    trainer, windows, initial, start = train_and_collect(
        trainer_cls, args, model=model_fn(), train_dataset=dataset, processing_class=word_tokenizer(), **kwargs
    )
    loss_fn = moe_window_loss if model_fn is tiny_mixtral else causal_lm_window_loss
    return update_error(initial, trainer.model, sgd_reference(start, windows, loss_fn))


def _causal_lm_rows(n: int) -> list[dict]:
    tok = word_tokenizer()
    rows = []
    for text in text_dataset(n)["text"]:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    return rows


def _pad_collator(rows: list[dict]) -> dict[str, torch.Tensor]:
    return pad_cat([{k: torch.tensor([v]) for k, v in r.items()} for r in rows], {"labels": -100})


def run_plain(trainer_cls, tmp, *, model_fn, lora_targets=None, stock=False, **options) -> float:
    """A model computing its own loss (PEFT LoRA-wrapped, or an MoE adding its router loss) in a plain Trainer."""
    torch.manual_seed(0)
    model = model_fn()
    if lora_targets:
        model = get_peft_model(model, _lora(lora_targets))
    args = (
        TrainingArguments(str(tmp), **TRAIN_ARGS) if stock else GradAccumArguments(str(tmp), **options, **TRAIN_ARGS)
    )
    trainer, windows, initial, start = train_and_collect(
        trainer_cls,
        args,
        model=model,
        train_dataset=_causal_lm_rows(NUM_SAMPLES),
        data_collator=_pad_collator,
    )
    loss_fn = moe_window_loss if model_fn is tiny_mixtral else causal_lm_window_loss
    return update_error(initial, trainer.model, sgd_reference(start, windows, loss_fn))


def run_seq2seq(trainer_cls, tmp, *, stock=False) -> float:
    torch.manual_seed(0)
    tok = word_tokenizer()
    args_cls = Seq2SeqTrainingArguments if stock else GradAccumSeq2SeqArguments
    args = args_cls(str(tmp), predict_with_generate=True, generation_max_length=8, **TRAIN_ARGS)
    model = tiny_t5()
    predictions = []

    def compute_metrics(eval_pred):
        predictions.append(eval_pred.predictions)
        return {"generated": float(eval_pred.predictions.shape[0])}

    trainer, windows, initial, start = train_and_collect(
        trainer_cls,
        args,
        model=model,
        train_dataset=seq2seq_dataset(NUM_SAMPLES, tok),
        eval_dataset=seq2seq_dataset(6, tok, seed=9),
        data_collator=DataCollatorForSeq2Seq(tok, model=model),
        processing_class=tok,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    # Evaluation generated (predict_with_generate) on every eval sample, through the composed trainer.
    assert metrics["eval_generated"] == 6 and predictions[0].ndim == 2, metrics
    return update_error(initial, trainer.model, sgd_reference(start, windows, causal_lm_window_loss))


def _reward_window_loss(model, window):
    """Mean over the window's pairs of -log sigmoid(r_chosen - r_rejected); a micro-batch holds its chosen rows, then
    its rejected rows (RewardTrainer's collator), so the pairs are formed per micro-batch and averaged over all."""
    terms = []
    for batch in window:
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        chosen, rejected = rewards.chunk(2)
        terms.append(-torch.nn.functional.logsigmoid(chosen - rejected))
    return torch.cat(terms).mean()


def run_reward(trainer_cls, tmp, *, stock=False) -> float:
    import datasets

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=1,
    )
    texts = text_dataset(2 * NUM_SAMPLES)["text"]
    dataset = datasets.Dataset.from_dict({"chosen": texts[::2], "rejected": texts[1::2]})
    args_cls = RewardConfig if stock else GradAccumRewardConfig
    args = args_cls(str(tmp), bf16=False, gradient_checkpointing=False, **TRAIN_ARGS)
    trainer, windows, initial, start = train_and_collect(
        trainer_cls,
        args,
        model=LlamaForSequenceClassification(config),
        train_dataset=dataset,
        processing_class=word_tokenizer(),
    )
    return update_error(initial, trainer.model, sgd_reference(start, windows, _reward_window_loss))


def _preference_dataset(n: int):
    import random

    import datasets

    rng = random.Random(5)
    words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))  # noqa: E731
    return datasets.Dataset.from_dict(
        {
            "prompt": [words() for _ in range(n)],
            "chosen": [words() for _ in range(n)],
            "rejected": [words() for _ in range(n)],
        }
    )


def _dpo_trainer(trainer_cls, args_cls, tmp, loss_type=("sigmoid",), **overrides):
    torch.manual_seed(0)
    model = tiny_llama()
    args = args_cls(
        str(tmp), bf16=False, gradient_checkpointing=False, loss_type=list(loss_type), **{**TRAIN_ARGS, **overrides}
    )
    return trainer_cls, dict(
        args=args,
        model=model,
        ref_model=copy.deepcopy(model),
        train_dataset=_preference_dataset(NUM_SAMPLES),
        processing_class=word_tokenizer(),
    )


def run_dpo(trainer_cls, tmp, *, stock=False) -> float:
    """DPO's log-probabilities go through TRL's fused LM head and masks; the large-batch reference is TRL's own
    DPOTrainer given each window as one batch (batch 16, no accumulation: windows of 16 and 6 pairs)."""
    big_cls, big_kwargs = _dpo_trainer(
        DPOTrainer, DPOConfig, tmp / "large_batch", per_device_train_batch_size=16, gradient_accumulation_steps=1
    )
    _, _, initial, _ = reference = train_and_collect(big_cls, big_kwargs.pop("args"), **big_kwargs)
    cls, kwargs = _dpo_trainer(trainer_cls, DPOConfig if stock else GradAccumDPOConfig, tmp / "accumulated")
    trainer, windows, initial_acc, _ = train_and_collect(cls, kwargs.pop("args"), **kwargs)
    assert torch.equal(initial, initial_acc) and [len(w) for w in windows] == [4, 2]
    return update_error(initial, trainer.model, reference[0].model)


# One entry per combination: name -> (ours, stock), each a callable(tmp_path) -> relative update error.
COMBINATIONS = {
    **{
        f"sft_{data}_{order}": (
            lambda tmp, c=cls, d=data: run_sft(c, tmp, data=d),
            lambda tmp, d=data: run_sft(SFTTrainer, tmp, data=d, stock=True),
        )
        for data in ("text", "completion_only")
        for order, cls in SFT_ORDERS.items()
    },
    **{
        f"sft_peft_lora_{order}": (
            lambda tmp, c=cls: run_sft(c, tmp, peft=True),
            lambda tmp: run_sft(SFTTrainer, tmp, peft=True, stock=True),
        )
        for order, cls in SFT_ORDERS.items()
    },
    "sft_moe_router_aux_loss": (
        # The per-micro-batch router term, named (the default is the exact window mode: tests/test_moe_balance.py).
        lambda tmp: run_sft(GradAccumFirstSFT, tmp, model_fn=tiny_mixtral, moe_load_balance="micro_batch"),
        lambda tmp: run_sft(SFTTrainer, tmp, model_fn=tiny_mixtral, stock=True),
    ),
    **{
        f"peft_lora_{family}": (
            lambda tmp, f=fn, t=targets: run_plain(GradAccumTrainer, tmp, model_fn=f, lora_targets=t),
            lambda tmp, f=fn, t=targets: run_plain(Trainer, tmp, model_fn=f, lora_targets=t, stock=True),
        )
        for family, fn, targets in (
            ("llama", tiny_llama, ["q_proj", "v_proj"]),
            ("qwen2", tiny_qwen2, ["q_proj", "v_proj"]),
            ("gpt2", tiny_gpt2, ["c_attn"]),
        )
    },
    "moe_model_loss_router_aux": (
        lambda tmp: run_plain(GradAccumTrainer, tmp, model_fn=tiny_mixtral, moe_load_balance="micro_batch"),
        lambda tmp: run_plain(Trainer, tmp, model_fn=tiny_mixtral, stock=True),
    ),
    "seq2seq_t5_predict_with_generate": (
        lambda tmp: run_seq2seq(GradAccumSeq2SeqTrainer, tmp),
        lambda tmp: run_seq2seq(Seq2SeqTrainer, tmp, stock=True),
    ),
    "dpo_sigmoid": (
        lambda tmp: run_dpo(GradAccumDPOTrainer, tmp),
        lambda tmp: run_dpo(DPOTrainer, tmp, stock=True),
    ),
    "reward_trainer": (
        lambda tmp: run_reward(GradAccumRewardTrainer, tmp),
        lambda tmp: run_reward(RewardTrainer, tmp, stock=True),
    ),
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_composition_matches_large_batch(name, tmp_path):
    err = COMBINATIONS[name][0](tmp_path)
    print(f"{name}: relative update error {err:.2e}")
    assert err <= RTOL, f"{name}: relative update error {err:.3e} > {RTOL}"


@pytest.mark.slow
def test_composition_error_table(tmp_path):
    """Ours next to the stock trainer on every combination (the table in docs/trl_peft.md)."""
    rows = ["| combination | GradAccum (ours) | stock trainer |", "|---|---|---|"]
    for name, (ours, stock) in COMBINATIONS.items():
        err_ours, err_stock = ours(tmp_path / f"{name}_ours"), stock(tmp_path / f"{name}_stock")
        rows.append(f"| {name} | {err_ours:.1e} | {err_stock:.1e} |")
        assert err_ours <= RTOL, name
    print("\n".join(rows))


@pytest.mark.slow
def test_torch_compiled_peft_gpt2_matches_large_batch(tmp_path, monkeypatch):
    """`torch_compile=True` (dynamo with the eager backend: the model runs as an `OptimizedModule` without needing a
    C compiler; about 20 s of tracing on CPU): items are still counted as GPT-2's shifted loss counts them."""
    monkeypatch.setitem(TRAIN_ARGS, "torch_compile", True)
    monkeypatch.setitem(TRAIN_ARGS, "torch_compile_backend", "eager")
    err = run_plain(GradAccumTrainer, tmp_path, model_fn=tiny_gpt2, lora_targets=["c_attn"])
    print(f"torch.compile + PEFT LoRA GPT-2: relative update error {err:.2e}")
    assert err <= RTOL
