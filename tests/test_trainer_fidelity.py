"""Everything the stock `Trainer` writes, `GradAccumTrainer` writes the same way: `train_results.json` /
`all_results.json` keys, `trainer_state.json` and `training_args.bin`, except the fields this project adds
(documented in docs/trainer_fidelity.md): `accumulator/*` log keys and the `GradAccumFields` arguments."""

from __future__ import annotations

import copy
import dataclasses
import json

import torch
from transformers import Trainer, TrainingArguments

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from hf_gradaccum.config.arguments import GradAccumFields
from hf_gradaccum.losses.accumulation_check import CHECK_FILE_NAME
from tests.ordering import SEQUENTIAL_ORDER
from tests.parity_cases import CASES

CASE = next(c for c in CASES if c.name == "bert_seq_cls")
ADDED_ARGUMENTS = {f.name for f in dataclasses.fields(GradAccumFields)}


def _run(trainer_cls, args_cls, output_dir, model, data):
    args = args_cls(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        num_train_epochs=2,
        **SEQUENTIAL_ORDER,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        average_tokens_across_devices=True,
    )
    trainer = trainer_cls(model=copy.deepcopy(model), args=args, train_dataset=data)
    metrics = trainer.train().metrics
    # What run_glue-style scripts do after training.
    trainer.save_model()
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return output_dir


def _is_ours(key: str) -> bool:
    return key.startswith("accumulator/")


def test_outputs_match_the_stock_trainer_except_documented_additions(tmp_path):
    torch.manual_seed(0)
    model = CASE.make_model()
    data = CASE.make_data(24, torch.Generator().manual_seed(1))
    stock = _run(Trainer, TrainingArguments, tmp_path / "stock", model, data)
    ours = _run(GradAccumTrainer, GradAccumArguments, tmp_path / "ours", model, data)

    # Same files, same checkpoints, no stray folders; plus the documented record of what the first window measured.
    assert sorted(p.name for p in ours.iterdir()) == sorted([*(p.name for p in stock.iterdir()), CHECK_FILE_NAME])
    assert json.loads((ours / CHECK_FILE_NAME).read_text())["loss_normalisation"]["rule"] == "label_tokens"

    for name in ("train_results.json", "all_results.json"):
        stock_keys = set(json.loads((stock / name).read_text()))
        our_keys = set(json.loads((ours / name).read_text()))
        assert "epoch" in our_keys, name  # `Trainer.log` adds it in place
        assert stock_keys <= our_keys, (name, stock_keys - our_keys)
        assert all(_is_ours(k) for k in our_keys - stock_keys), (name, our_keys - stock_keys)

    stock_state = json.loads((stock / "trainer_state.json").read_text())
    our_state = json.loads((ours / "trainer_state.json").read_text())
    assert set(stock_state) == set(our_state)
    for key, value in stock_state.items():
        if key not in ("log_history", "total_flos"):
            assert our_state[key] == value, key
    assert len(our_state["log_history"]) == len(stock_state["log_history"])
    for stock_entry, our_entry in zip(stock_state["log_history"], our_state["log_history"], strict=True):
        assert set(stock_entry) <= set(our_entry)
        assert all(_is_ours(k) for k in set(our_entry) - set(stock_entry)), set(our_entry) - set(stock_entry)
        assert our_entry["step"] == stock_entry["step"] and our_entry["epoch"] == stock_entry["epoch"]

    stock_args = torch.load(stock / "training_args.bin", weights_only=False).to_dict()
    our_args = torch.load(ours / "training_args.bin", weights_only=False).to_dict()
    assert set(our_args) - set(stock_args) == ADDED_ARGUMENTS
    differing = {k for k in stock_args if stock_args[k] != our_args[k] and k not in ("output_dir", "logging_dir")}
    assert not differing, {k: (stock_args[k], our_args[k]) for k in differing}
    # The user's value as TrainingArguments keeps it (True on 5.x; 4.x turns it off itself at world size 1), not
    # overwritten by GradAccumTrainer.
    kept = TrainingArguments("unused", average_tokens_across_devices=True, use_cpu=True).average_tokens_across_devices
    assert our_args["average_tokens_across_devices"] is kept
