"""`verify_accumulation` in GradAccumTrainer (issue 10): run on the real first window, logged, written as JSON, warns
or raises with the diagnosis; under 2 gloo processes every rank reaches the same verdict."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertForSequenceClassification, ResNetConfig, ResNetForImageClassification

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from hf_gradaccum.losses.accumulation_check import AccumulationNotExactError
from tests.multiprocess import launch
from tests.parity_cases import image_data, seq_cls_data, tiny_bert_config

TRAIN = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, report_to=[],
             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1)  # fmt: skip


def test_first_step_check_passes_on_bert_and_is_logged_and_written(tmp_path):
    torch.manual_seed(0)
    args = GradAccumArguments(str(tmp_path), verify_accumulation="first_step", **TRAIN)
    model = BertForSequenceClassification(tiny_bert_config(num_labels=3))
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=seq_cls_data(32, torch.Generator()))
    trainer.train()
    logged = [
        h["accumulator/verify_rel_diff"] for h in trainer.state.log_history if "accumulator/verify_rel_diff" in h
    ]
    assert len(logged) == 1 and logged[0] <= 1e-5  # once, on the first window only
    record = json.loads((tmp_path / "accumulation_check.json").read_text())
    assert record["passed"] and record["tolerance"] == 1e-5 and record["global_step"] == 0
    assert record["splits"]["window"] == [4, 4]


def test_off_by_default_writes_nothing(tmp_path):
    args = GradAccumArguments(str(tmp_path), **TRAIN)
    assert args.verify_accumulation == "off"
    trainer = GradAccumTrainer(
        model=BertForSequenceClassification(tiny_bert_config(num_labels=3)),
        args=args,
        train_dataset=seq_cls_data(32, torch.Generator()),
    )
    trainer.train()
    # The first window's loss normalisation is recorded by default; the split-invariance check is not.
    record = json.loads((tmp_path / "accumulation_check.json").read_text())
    assert "verdict" not in record and record["loss_normalisation"]["rule"] == "label_tokens", record


def _bn_resnet():
    config = ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1], layer_type="basic", num_labels=5
    )
    return ResNetForImageClassification(config)


def test_batchnorm_resnet_raises_with_the_diagnosis_before_any_step(tmp_path):
    torch.manual_seed(0)
    # Per-micro-batch statistics named, so that the split-invariance check is what stops it (by default the
    # first window's BatchNorm rule would: tests/test_model_losses.py).
    args = GradAccumArguments(
        str(tmp_path), verify_accumulation="first_step", verify_raise=True, batchnorm_statistics="micro_batch", **TRAIN
    )
    model = _bn_resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=image_data(32, torch.Generator()))
    with pytest.raises(AccumulationNotExactError, match="(?s)NOT exact.*batchnorm.*embedder.normalization"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats restored too
    assert not json.loads((tmp_path / "accumulation_check.json").read_text())["passed"]


def test_batchnorm_resnet_warns_and_trains_on(tmp_path, caplog):
    args = GradAccumArguments(
        str(tmp_path),
        verify_accumulation="every_n_steps",
        verify_every_n_steps=1,
        batchnorm_statistics="micro_batch",
        **TRAIN,
    )
    trainer = GradAccumTrainer(model=_bn_resnet(), args=args, train_dataset=image_data(32, torch.Generator()))
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert caplog.text.count("NOT exact for this model") == 2  # every step: steps 0 and 1
    assert "convert_batchnorm_to_groupnorm" in caplog.text


def test_bad_verify_options_are_refused():
    with pytest.raises(ValueError, match="`verify_accumulation` must be one of"):
        GradAccumArguments("out", verify_accumulation="always", use_cpu=True)
    with pytest.raises(ValueError, match="verify_every_n_steps"):
        GradAccumArguments("out", verify_accumulation="every_n_steps", verify_every_n_steps=0, use_cpu=True)


def test_two_gloo_ranks_agree_on_the_verdict(tmp_path):
    launch(str(tmp_path), script="tests/workers/verify_ddp.py")
    records = [json.loads((tmp_path / f"verdict_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["local_diagnosis"] for r in records] == [False, True]  # only rank 1's own window is inexact
    assert not records[0]["passed"] and not records[1]["passed"]
    assert records[0]["max_rel_diff"] == records[1]["max_rel_diff"] > 1e-3
    assert not json.loads((tmp_path / "accumulation_check.json").read_text())["passed"]


def test_bf16_autocast_check_uses_the_bf16_tolerance(tmp_path):
    torch.manual_seed(0)
    args = GradAccumArguments(str(tmp_path), verify_accumulation="first_step", bf16=True, **TRAIN)
    model = BertForSequenceClassification(tiny_bert_config(num_labels=3))
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=seq_cls_data(32, torch.Generator()))
    trainer.train()
    record = json.loads((tmp_path / "accumulation_check.json").read_text())
    assert record["tolerance"] == 4 * torch.finfo(torch.bfloat16).eps
    assert record["tolerance_rule"] == "bfloat16 computation"
    assert record["passed"], record["max_rel_diff"]


class _NoisyBert(BertForSequenceClassification):
    """A forward with randomness the check cannot switch off (noise drawn from torch's RNG in `forward`, not a
    dropout module or a config switch): the check must say it cannot decide, never "not exact"."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * torch.rand(()) * out.loss
        return out


def test_cannot_decide_is_reported_as_such_and_never_raises(tmp_path):
    torch.manual_seed(0)
    # Noise the probe cannot switch off: the measurement of the loss's count cannot run either, so the count is named.
    args = GradAccumArguments(str(tmp_path), verify_accumulation="first_step", verify_raise=True, **TRAIN,
                              loss_normalisation="label_tokens", check_declared_normalisation=False)  # fmt: skip
    trainer = GradAccumTrainer(
        model=_NoisyBert(tiny_bert_config(num_labels=3)), args=args, train_dataset=seq_cls_data(32, torch.Generator())
    )
    trainer.train()  # verify_raise=True: would raise on a "not exact" verdict
    record = json.loads((tmp_path / "accumulation_check.json").read_text())
    assert record["verdict"] == "cannot_decide" and not record["passed"], record
    assert trainer.state.global_step == 2
