"""bf16 and fp16 under accumulation: fp32 buffers keep bf16 precision independent of the number of micro-batches;
fp16 dynamic loss scaling recomputes only the overflowing micro-batch ("recompute") or drops the window ("skip");
the scaler's state survives checkpoints. Runs on CPU (CPU autocast in float16)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from tests.parity_cases import CASES, flat_params

CASE_BY_NAME = {c.name: c for c in CASES}


# ----------------------------------------------------------------------------- bf16 precision
def _bf16_gradient_errors(num_micro: int, seed: int, device: str = "cpu"):
    """Relative gradient error vs an fp64 reference of: one bf16 pass over the window, stock-style accumulation in
    the bf16 `.grad`, and the accumulator (fp32 buffers). bf16 parameters, micro-batches of 2."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model64 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).double()
    model64 = model64.to(device)
    x = torch.randn(num_micro * 2, 32, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(0, 8, (num_micro * 2,), generator=g).to(device)
    F.cross_entropy(model64(x), y).backward()
    reference = torch.cat([p.grad.flatten() for p in model64.parameters()])

    def bf16_copy():
        model = copy.deepcopy(model64).to(torch.bfloat16)
        model.zero_grad(set_to_none=True)
        return model

    def error(model):
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        return float((grad - reference).norm() / reference.norm())

    one_pass = bf16_copy()
    F.cross_entropy(one_pass(x.bfloat16()).float(), y).backward()

    stock = bf16_copy()
    for i in range(num_micro):
        (F.cross_entropy(stock(x[2 * i : 2 * i + 2].bfloat16()).float(), y[2 * i : 2 * i + 2]) / num_micro).backward()

    ours = bf16_copy()
    acc = GradientAccumulator(ours, num_micro)  # accumulation_dtype defaults to float32
    for i in range(num_micro):
        acc.backward(F.cross_entropy(ours(x[2 * i : 2 * i + 2].bfloat16()).float(), y[2 * i : 2 * i + 2]), num_items=2)
    acc.finish_window()
    return error(one_pass), error(stock), error(ours)


@pytest.mark.parametrize("num_micro", [64, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_parameters_fp32_buffers_keep_one_pass_precision(num_micro, seed):
    one_pass, stock, ours = _bf16_gradient_errors(num_micro, seed)
    print(
        f"bf16 {num_micro} micro-batches: one pass {one_pass:.2e}, stock x{stock / one_pass:.2f}, ours x{ours / one_pass:.2f}"
    )
    assert ours <= 1.25 * one_pass
    assert stock > ours  # the stock bf16 .grad accumulation is visibly worse (about 2.5x at 64, 5x at 256)


def _trainer_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
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
    return GradAccumArguments(**kwargs)


def test_bf16_autocast_trainer_matches_large_batch_within_bf16_tolerance(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(16, torch.Generator().manual_seed(0))
    acc = GradAccumTrainer(
        model=copy.deepcopy(model), args=_trainer_args(tmp_path / "a", bf16=True), train_dataset=data
    )
    acc.train()
    ref_args = _trainer_args(tmp_path / "r", bf16=True, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    ref = GradAccumTrainer(model=copy.deepcopy(model), args=ref_args, train_dataset=data)
    ref.train()
    assert acc.accumulator.loss_scaler is None  # no loss scaling under bf16 by default
    w0 = flat_params(model)
    err = float(
        ((flat_params(acc.model) - w0) - (flat_params(ref.model) - w0)).norm() / (flat_params(ref.model) - w0).norm()
    )
    print(f"bf16 autocast, 4 x 2 vs 8 x 1: relative update error {err:.2e}")
    assert err <= 2e-2  # bf16 autocast: ~3 significant digits per matmul


# ----------------------------------------------------------------------------- fp16 overflow policies
OVERFLOW_SAMPLE = 4  # micro-batch k=2 (of 4) holds it


def _regression_window(overflow: bool):
    """8 samples = one window of 4 micro-batches of 2. With `overflow`, sample 4's label is 300: its gradient
    (~300 per item) times a loss scale of 2**12 exceeds fp16's 65504, while the loss itself stays finite."""
    data = CASE_BY_NAME["bert_regression"].make_data(8, torch.Generator().manual_seed(6))
    labels = list(data["labels"])
    labels[OVERFLOW_SAMPLE] = 300.0
    return data.remove_columns("labels").add_column("labels", labels)


def _fp16_trainer(tmp_path, model, data, **overrides):
    args = _trainer_args(tmp_path, **{"fp16": True, "loss_scale_init": 2.0**12, **overrides})
    return GradAccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)


def test_fp16_recompute_redoes_only_the_overflowing_micro_batch(tmp_path):
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_regression"].make_model()
    data = _regression_window(overflow=True)
    # The rule named (a regression head: a mean over rows) and left unchecked, so that every forward counted here is
    # training's.
    trainer = _fp16_trainer(
        tmp_path / "recompute",
        model,
        data,
        overflow_policy="recompute",
        loss_normalisation="rows",
        check_declared_normalisation=False,
    )
    calls = []
    original = trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: calls.append(1) or original(*a, **k)
    trainer.train()
    acc = trainer.accumulator
    assert trainer.state.global_step == 1 and acc.applied_steps == 1
    assert acc.recomputed_micro_batches == 1
    backoffs = acc.loss_scaler.num_overflows
    assert acc.loss_scaler.scale == 2.0**12 * 0.5**backoffs < 2.0**12
    assert len(calls) == 4 + backoffs  # one forward per micro-batch, plus one per retry of micro-batch k only

    # The same window at a scale that never overflows: the update must agree within fp16 tolerance.
    clean = _fp16_trainer(tmp_path / "clean", model, data, loss_scale_init=acc.loss_scaler.scale)
    clean.train()
    assert clean.accumulator.loss_scaler.num_overflows == 0
    w0 = flat_params(model)
    d, d_clean = flat_params(trainer.model) - w0, flat_params(clean.model) - w0
    err = float((d - d_clean).norm() / d_clean.norm())
    print(f"fp16 recompute: {backoffs} backoffs, relative update error vs no-overflow window {err:.2e}")
    assert err <= 5e-3  # fp16: the first micro-batches were back-propagated at a different scale


def test_fp16_skip_drops_the_window_and_leaves_everything_untouched(tmp_path):
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_regression"].make_model()
    trainer = _fp16_trainer(tmp_path, model, _regression_window(overflow=True), overflow_policy="skip")
    trainer.train()
    acc = trainer.accumulator
    # As the stock Trainer after a GradScaler overflow: global_step advances, the scheduler does not step.
    assert trainer.state.global_step == 1 and acc.applied_steps == 0
    assert acc.skipped_steps == {"overflow": 1}
    assert acc.loss_scaler.scale == 2.0**11  # backed off once
    assert torch.equal(flat_params(trainer.model), flat_params(model))
    assert all(len(s) == 0 for s in trainer.optimizer.state.values())
    assert trainer.lr_scheduler.last_epoch == 0


def test_fp16_scale_grows_after_growth_interval_clean_steps(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    data = case.make_data(32, torch.Generator().manual_seed(0))  # 4 windows
    trainer = GradAccumTrainer(
        model=case.make_model(),
        args=_trainer_args(
            tmp_path, fp16=True, loss_scale_init=16.0, loss_scale_growth_interval=2, learning_rate=0.01
        ),
        train_dataset=data,
    )
    trainer.train()
    assert trainer.accumulator.applied_steps == 4
    assert trainer.accumulator.loss_scaler.scale == 64.0  # grew after steps 2 and 4
    scales = [h["accumulator/loss_scale"] for h in trainer.state.log_history if "accumulator/loss_scale" in h]
    assert scales[:4] == [16.0, 32.0, 32.0, 64.0]


def test_fp16_resume_restores_scaler_and_equals_uninterrupted_run(tmp_path):
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(48, torch.Generator().manual_seed(0))  # 6 windows
    overrides = dict(
        fp16=True,
        loss_scale_init=16.0,
        loss_scale_growth_interval=3,
        learning_rate=0.01,
        save_strategy="steps",
        save_steps=2,
    )
    full = GradAccumTrainer(
        model=copy.deepcopy(model), args=_trainer_args(tmp_path / "full", **overrides), train_dataset=data
    )
    full.train()
    resumed = GradAccumTrainer(
        model=copy.deepcopy(model), args=_trainer_args(tmp_path / "resumed", **overrides), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.accumulator.loss_scaler.state_dict() == full.accumulator.loss_scaler.state_dict()
    assert full.accumulator.loss_scaler.scale == 64.0
    assert torch.equal(flat_params(resumed.model), flat_params(full.model))


def test_resume_with_another_effective_batch_warns_or_is_refused_on_request(tmp_path, caplog):
    case = CASE_BY_NAME["bert_seq_cls"]
    data = case.make_data(16, torch.Generator().manual_seed(0))
    first = GradAccumTrainer(
        model=case.make_model(), args=_trainer_args(tmp_path, save_strategy="steps", save_steps=1), train_dataset=data
    )
    first.train()
    # Default, as the stock Trainer: resume with a new batch (warned).
    other = GradAccumTrainer(
        model=case.make_model(), args=_trainer_args(tmp_path, gradient_accumulation_steps=2), train_dataset=data
    )
    other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert "effective batch of 8" in caplog.text
    assert other.state.global_step == 4
    # Opt-in policy: refused.
    refusing = GradAccumTrainer(
        model=case.make_model(),
        args=_trainer_args(tmp_path, gradient_accumulation_steps=2, refuse_resume_with_different_batch=True),
        train_dataset=data,
    )
    with pytest.raises(ValueError, match="effective batch"):
        refusing.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
