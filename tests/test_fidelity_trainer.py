"""Differential fidelity: the same tiny script with the stock `transformers.Trainer` and with `GradAccumTrainer`
(same arguments, same seed, no accumulation option changed) does and writes the same things. The stock Trainer is the
specification; where the two differ on purpose, docs/trainer_fidelity.md says why and the test checks that difference.

Weights and logged values are compared to 1e-5 relative (fp32) with `gradient_accumulation_steps=1` and equal
micro-batches; with more accumulation steps the structure (steps, keys, checkpoints) is compared.
"""

from __future__ import annotations

import pytest
import torch
from transformers import SchedulerType, TrainerCallback

from hf_gradaccum import GradAccumTrainer
from tests.fidelity_support import (
    RTOL,
    assert_logs_match,
    assert_weights_match,
    checkpoints,
    close,
    make,
    outcome,
    read_state,
    relative,
    tiny_model,
)

SIDES = ("stock", "ours")


def _pair(tmp_path, train=True, **kwargs):
    trainers = {side: make(side, tmp_path, **kwargs) for side in SIDES}
    if train:
        for trainer in trainers.values():
            trainer.train()
    return trainers["stock"], trainers["ours"]


def _assert_states_match(stock_dir, our_dir, values=True):
    s, o = read_state(stock_dir), read_state(our_dir)
    assert set(s) == set(o)
    for key in s:
        if key == "log_history":
            assert_logs_match(s[key], o[key], values=values)
        elif key == "best_model_checkpoint":
            assert relative(s[key]) == relative(o[key])
        elif key in ("best_metric",) and values:
            assert close(s[key], o[key]), (key, s[key], o[key])
        elif key not in ("best_metric", "total_flos"):
            assert s[key] == o[key], (key, s[key], o[key])


# ----------------------------------------------------------------------------------------- logs, state, eval, predict
def test_run_with_checkpoints_evaluation_and_prediction_matches_stock(tmp_path):
    stock, ours = _pair(
        tmp_path,
        eval_n=8,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
    )
    assert_logs_match(stock.state.log_history, ours.state.log_history)
    assert_weights_match(stock.model, ours.model)
    assert checkpoints(tmp_path / "stock") == checkpoints(tmp_path / "ours")
    for name in checkpoints(tmp_path / "stock"):
        _assert_states_match(tmp_path / "stock" / name, tmp_path / "ours" / name)
        stock_files = {p.name for p in (tmp_path / "stock" / name).iterdir()}
        our_files = {p.name for p in (tmp_path / "ours" / name).iterdir()}
        assert our_files - stock_files == {"accumulator_state.pt"}, our_files ^ stock_files
    stock_eval, our_eval = stock.evaluate(), ours.evaluate()
    assert set(stock_eval) == set(our_eval)
    assert all(close(stock_eval[k], our_eval[k]) for k in stock_eval if "runtime" not in k and "per_second" not in k)
    stock_pred, our_pred = stock.predict(stock.eval_dataset), ours.predict(ours.eval_dataset)
    torch.testing.assert_close(torch.as_tensor(our_pred.predictions), torch.as_tensor(stock_pred.predictions))
    assert (our_pred.label_ids == stock_pred.label_ids).all()


def test_accumulation_keeps_steps_keys_and_checkpoints_of_stock(tmp_path):
    stock, ours = _pair(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2, save_strategy="epoch")
    assert_logs_match(stock.state.log_history, ours.state.log_history, values=False)
    assert checkpoints(tmp_path / "stock") == checkpoints(tmp_path / "ours")
    _assert_states_match(tmp_path / "stock" / "checkpoint-4", tmp_path / "ours" / "checkpoint-4", values=False)
    # The gradient (and the logged loss) differ on purpose: for a model whose forward accepts `**kwargs` but whose
    # loss ignores `num_items_in_batch` (BERT), transformers 5.x sums the micro-batch means (twice the large-batch
    # gradient here); ours is the large-batch mean. See docs/trainer_fidelity.md.


def test_diverging_run_logs_nan_losses_like_stock(tmp_path):
    stock, ours = _pair(tmp_path, learning_rate=1e12, logging_nan_inf_filter=False, max_grad_norm=0.0)
    assert stock.state.global_step == ours.state.global_step == 4
    stock_log = [h for h in stock.state.log_history if "loss" in h]
    our_log = [h for h in ours.state.log_history if "loss" in h]
    assert [h["step"] for h in our_log] == [h["step"] for h in stock_log]
    assert any(not torch.isfinite(torch.tensor(h["loss"])) for h in stock_log)
    assert any(not torch.isfinite(torch.tensor(h["loss"])) for h in our_log)
    # Documented difference: a non-finite update is never written into the weights.
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())
    assert ours.lr_scheduler.last_epoch == stock.lr_scheduler.last_epoch


# ------------------------------------------------------------------------------------------------------ schedulers
SCHEDULER_KWARGS = {
    "cosine_with_min_lr": {"min_lr": 1e-4},
    "cosine_warmup_with_min_lr": {"min_lr": 1e-4},
    "warmup_stable_decay": {"num_decay_steps": 2},
}
FAST_SCHEDULERS = {"greedy"}  # the one stepped with metrics; every other type is in the slow run


@pytest.mark.parametrize(
    "name",
    [pytest.param(s.value, marks=() if s.value in FAST_SCHEDULERS else pytest.mark.slow) for s in SchedulerType],
)
def test_every_scheduler_type_by_name_matches_stock(tmp_path, name):
    overrides = dict(lr_scheduler_type=name, warmup_steps=2, lr_scheduler_kwargs=SCHEDULER_KWARGS.get(name, {}))
    if name in ("reduce_lr_on_plateau", "greedy"):  # stepped with evaluation metrics
        overrides.update(eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss")
    stock, ours = _pair(tmp_path, train=False, eval_n=8, **overrides)
    stock_result, our_result = outcome(stock.train), outcome(ours.train)
    assert stock_result[0] == our_result[0], (stock_result, our_result)
    if stock_result[0] == "error":
        assert stock_result[1:] == our_result[1:]
        return
    assert type(ours.lr_scheduler) is type(stock.lr_scheduler)
    assert_logs_match(stock.state.log_history, ours.state.log_history)
    assert_weights_match(stock.model, ours.model)


@pytest.mark.parametrize("kind", ["lambda", "greedy"])
def test_user_supplied_scheduler_stays_the_users_object(tmp_path, kind):
    if kind == "greedy":
        # GreedyLR is transformers 5.x only; on 4.x the metric-stepped case is ReduceLROnPlateau, which 5.x has too.
        GreedyLR = getattr(__import__("transformers.optimization", fromlist=["x"]), "GreedyLR", None)
        metric_scheduler = GreedyLR or torch.optim.lr_scheduler.ReduceLROnPlateau

    results = {}
    for side in SIDES:
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if kind == "lambda":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
            extra = {}
        else:
            scheduler = metric_scheduler(optimizer, patience=1)
            extra = dict(eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss")
        trainer = make(side, tmp_path, model=model, optimizers=(optimizer, scheduler), eval_n=8, **extra)
        trainer.train()
        assert trainer.lr_scheduler is scheduler
        results[side] = trainer
    assert_logs_match(results["stock"].state.log_history, results["ours"].state.log_history)
    assert_weights_match(results["stock"].model, results["ours"].model)


# -------------------------------------------------------------------------------------- saving, best-model tracking
@pytest.mark.parametrize(
    ("save", "evaluate", "load_best"),
    [
        ("steps", "epoch", False),  # eval per epoch, saves per step
        ("steps", "steps", True),
        ("epoch", "epoch", True),
        pytest.param("best", "steps", False, marks=pytest.mark.slow),
        pytest.param("epoch", "steps", True, marks=pytest.mark.slow),  # refused by the stock Trainer
        pytest.param("steps", "no", False, marks=pytest.mark.slow),
    ],
)
def test_save_and_eval_strategies_track_the_best_model_like_stock(tmp_path, save, evaluate, load_best):
    overrides = dict(
        save_strategy=save,
        save_steps=2,
        eval_strategy=evaluate,
        eval_steps=2,
        save_total_limit=2,
        load_best_model_at_end=load_best,
        metric_for_best_model="eval_loss" if evaluate != "no" else None,
    )
    results = {side: outcome(lambda side=side: make(side, tmp_path, eval_n=8, **overrides)) for side in SIDES}
    assert results["stock"][0] == results["ours"][0], results
    if results["stock"][0] == "error":
        assert results["stock"][1:] == results["ours"][1:]
        return
    stock, ours = results["stock"][1], results["ours"][1]
    stock.train()
    ours.train()
    assert relative(ours.state.best_model_checkpoint) == relative(stock.state.best_model_checkpoint)
    if load_best:
        assert stock.state.best_model_checkpoint is not None
    assert close(stock.state.best_metric, ours.state.best_metric)
    assert stock.state.best_global_step == ours.state.best_global_step
    assert checkpoints(tmp_path / "stock") == checkpoints(tmp_path / "ours")
    assert_weights_match(stock.model, ours.model)


# ---------------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "resume_batch", [pytest.param(4, id="same-batch", marks=pytest.mark.slow), pytest.param(2, id="different-batch")]
)
def test_resume_matches_stock(tmp_path, resume_batch):
    first = {side: make(side, tmp_path, save_strategy="steps", save_steps=3) for side in SIDES}
    for trainer in first.values():
        trainer.train()
    resumed = {}
    for side in SIDES:
        trainer = make(side, tmp_path, per_device_train_batch_size=resume_batch, save_strategy="no")
        trainer.train(resume_from_checkpoint=True)
        resumed[side] = trainer
    assert resumed["stock"].state.global_step == resumed["ours"].state.global_step
    assert_logs_match(resumed["stock"].state.log_history, resumed["ours"].state.log_history)
    assert_weights_match(resumed["stock"].model, resumed["ours"].model)


def test_resume_true_without_checkpoint_raises_like_stock(tmp_path):
    stock, ours = _pair(tmp_path, train=False)
    stock_result = outcome(lambda: stock.train(resume_from_checkpoint=True))
    our_result = outcome(lambda: ours.train(resume_from_checkpoint=True))
    assert stock_result[0] == "error" and "No valid checkpoint found" in stock_result[2]
    assert our_result == stock_result


# --------------------------------------------------------------------------------------- optimizers, loss, features
@pytest.mark.parametrize(
    "optim",
    ["sgd", *(pytest.param(o, marks=pytest.mark.slow) for o in ("adamw_torch", "adafactor", "adagrad", "rmsprop"))],
)
def test_optimizers_by_name_match_stock(tmp_path, optim):
    stock, ours = _pair(tmp_path, optim=optim)
    assert type(ours.optimizer.optimizer) is type(stock.optimizer.optimizer)
    assert_logs_match(stock.state.log_history, ours.state.log_history)
    assert_weights_match(stock.model, ours.model)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"label_smoothing_factor": 0.1}, id="label-smoothing"),
        pytest.param({"gradient_checkpointing": True}, id="gradient-checkpointing", marks=pytest.mark.slow),
        pytest.param({"max_grad_norm": 0.01}, id="clipping", marks=pytest.mark.slow),
        pytest.param({"max_steps": 3}, id="max-steps", marks=pytest.mark.slow),
    ],
)
def test_training_features_match_stock(tmp_path, overrides):
    stock, ours = _pair(tmp_path, **overrides)
    assert_logs_match(stock.state.log_history, ours.state.log_history)
    assert_weights_match(stock.model, ours.model)


class EventRecorder(TrainerCallback):
    """Records every callback event with the step it saw."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                events.append((name, state.global_step))
                return control

            return record
        return object.__getattribute__(self, name)


def test_callbacks_are_called_in_the_stock_order(tmp_path):
    recorders = {side: EventRecorder() for side in SIDES}
    for side in SIDES:
        trainer = make(
            side,
            tmp_path,
            eval_n=8,
            callbacks=[recorders[side]],
            save_strategy="steps",
            save_steps=3,
            eval_strategy="steps",
            eval_steps=3,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
        )
        trainer.train()
    assert recorders["ours"].events == recorders["stock"].events
    assert ("on_substep_end", 0) in recorders["stock"].events


def test_training_step_outside_train_matches_stock(tmp_path):
    stock, ours = _pair(tmp_path, train=False)
    batch = next(iter(stock.get_train_dataloader()))
    # transformers 5.23's own `training_step` needs `current_gradient_accumulation_steps`, which only `train()` sets
    # (AttributeError otherwise); ours works without it. Give the stock Trainer the value `train()` would.
    assert outcome(lambda: stock.training_step(stock.model, dict(batch)))[0] == "error"
    stock.model.zero_grad()
    stock.current_gradient_accumulation_steps = 1
    losses = {}
    for side, trainer in (("stock", stock), ("ours", ours)):
        trainer.model.train()
        losses[side] = trainer.training_step(trainer.model, dict(batch))
    assert close(float(losses["stock"]), float(losses["ours"]))
    for p_stock, p_ours in zip(stock.model.parameters(), ours.model.parameters(), strict=True):
        torch.testing.assert_close(p_ours.grad, p_stock.grad, rtol=RTOL, atol=1e-7)


def test_hyperparameter_search_matches_stock(tmp_path):
    optuna = pytest.importorskip(
        "optuna", reason="optuna is not installed: Trainer.hyperparameter_search needs a backend"
    )
    from tests.fidelity_support import TRAINERS, args, data

    results = {}
    for side in SIDES:
        trainer = TRAINERS[side](
            model_init=tiny_model,
            args=args(tmp_path / side, eval_strategy="epoch"),
            train_dataset=data(16),
            eval_dataset=data(8, seed=2),
        )
        results[side] = trainer.hyperparameter_search(
            hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)},
            n_trials=2,
            direction="minimize",
            backend="optuna",
            sampler=optuna.samplers.TPESampler(seed=0),  # both sides try the same learning rates
        )
    assert results["stock"].hyperparameters == results["ours"].hyperparameters
    assert close(results["stock"].objective, results["ours"].objective)


def test_hyperparameter_search_trials_keep_the_window_scaler(tmp_path):
    """fp16, where the Accelerator must hold the window's scaler: every optimizer step of every trial of a
    hyperparameter search (which may re-create the Accelerator per trial) runs with `WindowGradScaler`, and the best
    trial's objective equals a plain run at its learning rate (1e-5 relative)."""
    pytest.importorskip("optuna", reason="optuna is not installed: Trainer.hyperparameter_search needs a backend")
    from hf_gradaccum.trainer.step_gating import WindowGradScaler
    from tests.fidelity_support import args, data

    scalers = []

    class RecordScaler(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scalers.append(type(searching.accelerator.scaler))

    def build(output_dir, **overrides):
        return GradAccumTrainer(
            model_init=tiny_model,
            args=args(output_dir, fp16=True, gradient_accumulation_steps=2, eval_strategy="epoch", **overrides),
            train_dataset=data(16),
            eval_dataset=data(8, seed=2),
        )

    searching = build(tmp_path / "search")
    searching.add_callback(RecordScaler())
    best = searching.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)},
        n_trials=2,
        direction="minimize",
        backend="optuna",
    )
    assert len(scalers) == 2 * 2 and set(scalers) == {WindowGradScaler}  # 2 trials x 2 windows of 2 x 4
    plain = build(tmp_path / "plain", learning_rate=best.hyperparameters["learning_rate"])
    plain.train()
    assert close(best.objective, plain.evaluate()["eval_loss"])
