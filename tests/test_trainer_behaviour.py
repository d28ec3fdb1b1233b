"""GradAccumTrainer beyond one SGD step: AdamW + clipping over several steps, skipped windows (NaN, no items)
and the counters around them, and argument validation."""

import copy

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from tests.parity_cases import CASES, flat_params, large_batch_reference, relative_update_error

CASE_BY_NAME = {c.name: c for c in CASES}


def _args(tmp_path, cls=GradAccumArguments, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def test_adamw_with_clipping_five_steps_matches_large_batch(tmp_path):
    """AdamW, max_grad_norm=1.0, 5 optimizer steps: 2 x 4 accumulated vs one batch of 8 (stock Trainer, no
    accumulation). Final weights within 1e-4 relative."""
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(40, torch.Generator().manual_seed(2))
    acc_trainer = GradAccumTrainer(
        model=copy.deepcopy(model), args=_args(tmp_path / "acc", max_grad_norm=1.0), train_dataset=data
    )
    acc_trainer.train()
    ref_args = _args(
        tmp_path / "ref",
        cls=TrainingArguments,
        max_grad_norm=1.0,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    ref_trainer = Trainer(model=copy.deepcopy(model), args=ref_args, train_dataset=data)
    ref_trainer.train()
    assert acc_trainer.state.global_step == ref_trainer.state.global_step == 5
    w0, w_acc, w_ref = flat_params(model), flat_params(acc_trainer.model), flat_params(ref_trainer.model)
    rel = float((w_acc - w_ref).norm() / (w_ref - w0).norm())
    print(f"AdamW 5 steps: relative distance of final weights (vs the update size) {rel:.2e}")
    assert float((w_acc - w_ref).norm() / w_ref.norm()) <= 1e-4
    # Per-step logged losses are the large-batch losses.
    acc_losses = [h["loss"] for h in acc_trainer.state.log_history if "loss" in h]
    ref_losses = [h["loss"] for h in ref_trainer.state.log_history if "loss" in h]
    assert acc_losses == pytest.approx(ref_losses, abs=1e-5)


def _regression_data_with_nan(n, nan_index):
    data = CASE_BY_NAME["bert_regression"].make_data(n, torch.Generator().manual_seed(4))
    labels = list(data["labels"])
    labels[nan_index] = float("nan")
    return data.remove_columns("labels").add_column("labels", labels)


@pytest.mark.parametrize("take_back", [False, True])
def test_nan_window_is_skipped_with_counters_and_state_untouched(tmp_path, take_back):
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_regression"].make_model()
    # 24 samples, 2 x 4 per window: 3 windows; sample 9 (window 2) has a NaN label, so that window's loss is NaN.
    data = _regression_data_with_nan(24, 9)
    args = _args(tmp_path, max_grad_norm=1.0, take_back_skipped_steps=take_back)
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # Default: as the stock Trainer, every window is a step and the scheduler steps after it. Opt-in policy: a
    # skipped window advances neither.
    steps = 2 if take_back else 3
    assert trainer.state.global_step == steps
    assert trainer.lr_scheduler.last_epoch == steps
    assert trainer.accumulator.applied_steps == 2
    assert trainer.accumulator.skipped_steps == {"non_finite_loss": 1}
    # Either way the non-finite update is never written into weights or optimizer state.
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        assert int(state["step"]) == 2  # AdamW's own step count skipped the bad window too
        assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()
    logged = [h for h in trainer.state.log_history if "accumulator/skipped_steps" in h]
    assert logged and logged[-1]["accumulator/skipped_steps"] == 1


def test_window_without_items_is_skipped(tmp_path):
    case = CASE_BY_NAME["bert_token_cls"]
    torch.manual_seed(0)
    data = case.make_data(16, torch.Generator().manual_seed(4))
    labels = list(data["labels"])
    for i in range(8, 16):  # the whole second window is ignored
        labels[i] = [-100] * len(labels[i])
    data = data.remove_columns("labels").add_column("labels", labels)
    trainer = GradAccumTrainer(model=case.make_model(), args=_args(tmp_path), train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2  # as the stock Trainer: the window is a step (its update is not applied)
    assert trainer.accumulator.skipped_steps == {"no_items": 1}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"accumulation_dtype": "int8"}, "accumulation_dtype"),
        ({"overflow_policy": "retry"}, "overflow_policy"),
        ({"loss_scale_init": 0.0}, "loss_scale_init"),
        ({"loss_scale_init": -1.0}, "loss_scale_init"),
        ({"loss_scale_growth_interval": 0}, "loss_scale_growth_interval"),
        ({"loss_scale_backoff_factor": 1.0}, "loss_scale_backoff_factor"),
        ({"loss_scale_backoff_factor": 0.0}, "loss_scale_backoff_factor"),
        ({"loss_scale_growth_factor": 1.0}, "loss_scale_growth_factor"),
        ({"lr_scaling_rule": "cubic"}, "lr_scaling_rule"),
        ({"lr_scaling_rule": "linear"}, "reference_batch_size"),
        ({"fp16": True, "bf16": True}, "fp16"),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path, overrides, argument):
    with pytest.raises(ValueError, match=argument):
        _args(tmp_path, **overrides)


def test_plain_training_arguments_with_bad_steps_are_refused(tmp_path):
    args = _args(tmp_path, cls=TrainingArguments)
    args.gradient_accumulation_steps = 2.5
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradAccumTrainer(
            model=CASE_BY_NAME["bert_seq_cls"].make_model(),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"labels": [0]}),
        )


def test_opt_in_batch_policies_apply_once_at_construction(tmp_path):
    """`lr_scaling_rule` and `batchnorm_momentum_correction` are opt-in policies applied when the trainer is built
    (before the optimizer and scheduler exist), not overrides of `train()`; off, the arguments are untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, momentum=0.1))
    plain = GradAccumTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "plain"))
    assert plain.args.learning_rate == 1e-3 and plain.model[1].momentum == 0.1
    args = _args(
        tmp_path / "policies", lr_scaling_rule="linear", reference_batch_size=4, batchnorm_momentum_correction=True
    )
    trainer = GradAccumTrainer(model=model, args=args)
    assert trainer.args.learning_rate == pytest.approx(2e-3)  # effective batch 2 x 4 = 8, tuned at 4
    trainer.create_optimizer()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert trainer.model[1].momentum == pytest.approx(1 - 0.9 ** (1 / 4))


def test_effective_batch_callback_works_with_the_stock_trainer(tmp_path, caplog):
    """The same policies as a plain callback of the stock `Trainer`: the rate is scaled before the optimizer exists,
    once per arguments object, BatchNorm momentum is corrected, and linear scaling without warmup warns at train
    start with a warmup suggestion; bad values name the argument."""
    from hf_gradaccum import EffectiveBatchCallback

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, momentum=0.1))
    callback = EffectiveBatchCallback("sqrt", reference_batch_size=2, batchnorm_momentum_correction=True)
    args = _args(tmp_path / "stock", cls=TrainingArguments)
    trainer = Trainer(model=model, args=args, callbacks=[callback])
    assert trainer.args.learning_rate == pytest.approx(2e-3)  # sqrt(8 / 2) x 1e-3
    callback.on_init_end(args, trainer.state, trainer.control, model=model)  # a repeated event changes nothing
    assert trainer.args.learning_rate == pytest.approx(2e-3)
    trainer.create_optimizer()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert model[1].momentum == pytest.approx(1 - 0.9 ** (1 / 4))

    case = CASE_BY_NAME["bert_seq_cls"]
    linear = EffectiveBatchCallback("linear", reference_batch_size=2)
    trainer = Trainer(
        model=case.make_model(),
        args=_args(tmp_path / "linear", cls=TrainingArguments),
        train_dataset=case.make_data(16, torch.Generator().manual_seed(0)),
        callbacks=[linear],
    )
    with caplog.at_level("WARNING", logger="hf_gradaccum.trainer.effective_batch"):
        trainer.train()
    assert trainer.args.learning_rate == pytest.approx(4e-3)
    assert any("consider `warmup_steps=10`" in r.getMessage() for r in caplog.records)  # 5 epochs x 2 steps

    with pytest.raises(ValueError, match="lr_scaling_rule"):
        EffectiveBatchCallback("cubic")
    with pytest.raises(ValueError, match="reference_batch_size"):
        EffectiveBatchCallback("linear")
    with pytest.raises(ValueError, match="batchnorm_momentum_correction"):
        EffectiveBatchCallback(batchnorm_momentum_correction="yes")


@pytest.mark.parametrize("path", ["auto", "in_place"])
def test_parent_step_and_accelerator_backward_run_once_per_micro_batch_unpatched(path, tmp_path, monkeypatch):
    """Each micro-batch runs the parent's own `training_step` and `Accelerator.backward` once, with no scaler
    installed (fp32, as in the stock Trainer), the Accelerator's `backward` routed through the accumulator only while
    the micro-batch runs (on the hook path too: the parent is the user's own class, whose division of the loss by the
    accumulation steps would be undone there), the Trainer's own accumulation steps and
    `average_tokens_across_devices` in place (transformers >= 5.19; older releases see the steps presented as 1), and
    the update equals the large batch's: one SGD step of 2 x 4 vs the stock Trainer on one batch of 8, 1e-5
    relative."""
    from accelerate import Accelerator

    from hf_gradaccum.config.compat import trainer_reads_loss_is_scaled_for_ga

    backward_calls = []
    original_backward = Accelerator.backward

    def counting_backward(self, loss, **kwargs):
        backward_calls.append(float(loss.detach()))
        return original_backward(self, loss, **kwargs)

    monkeypatch.setattr(Accelerator, "backward", counting_backward)
    swapped, routed, seen = [], [], []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            # fp32: no scaler, as in the stock Trainer.
            swapped.append(self.accelerator.scaler is not None)
            routed.append("backward" in vars(self.accelerator))
            seen.append((self.current_gradient_accumulation_steps, self.args.average_tokens_across_devices))
            return super().training_step(model, inputs, num_items_in_batch)

    class Composed(GradAccumTrainer, Recording):
        pass

    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(8, torch.Generator().manual_seed(3))
    args = _args(tmp_path / "ours", optim="sgd", average_tokens_across_devices=True, accumulation_path=path)
    ours = Composed(model=copy.deepcopy(model), args=args, train_dataset=data)
    ours.train()
    # "auto" keeps the hook path under a `training_step` it does not know (this test's `Recording`).
    assert ours.accumulator.in_place is (path == "in_place")
    assert swapped == [False] * 4 and routed == [True] * 4
    assert "backward" not in vars(ours.accelerator)  # the class's own again after each micro-batch
    assert "backward" not in vars(ours.accelerator)
    assert seen == [(4 if trainer_reads_loss_is_scaled_for_ga() else 1, True)] * 4
    assert len(backward_calls) == 4
    ref_args = _args(
        tmp_path / "ref",
        cls=TrainingArguments,
        optim="sgd",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    ref = Trainer(model=copy.deepcopy(model), args=ref_args, train_dataset=data)
    ref.train()
    w0, w_ours, w_ref = flat_params(model), flat_params(ours.model), flat_params(ref.model)
    err = float((w_ours - w_ref).norm() / (w_ref - w0).norm())
    print(f"unpatched parent step: relative update error vs large batch {err:.2e}")
    assert err <= 1e-5


def test_each_micro_batch_is_counted_once_per_window(tmp_path):
    """Items are counted when the window is prefetched and reused at each micro-step: counting again there would
    read the labels from the device (a host synchronisation) once per micro-batch. Uneven windows: 10 samples, 2 x 4
    then a partial window of 1 micro-batch; the update still equals the large batch's."""

    class CountingTrainer(GradAccumTrainer):
        calls = 0

        def count_micro_batch_items(self, inputs):
            CountingTrainer.calls += 1
            return super().count_micro_batch_items(inputs)

    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(10, torch.Generator().manual_seed(2))
    # The override is a declaration, which the first window checks on its cuts (more calls): left unchecked here, so
    # that every call counted is training's.
    args = _args(tmp_path, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                 check_declared_normalisation=False)  # fmt: skip
    trainer = CountingTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 2
    # 4 + 1 micro-batches, each counted once, and one call on the first window (does the override declare terms?)
    assert CountingTrainer.calls == 6
    reference = large_batch_reference(case, model, data, [list(range(8)), [8, 9]])
    assert relative_update_error(model, trainer.model, reference) <= 1e-5
