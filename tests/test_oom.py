"""OOM-proof training: `auto_find_batch_size=True` halves the micro-batch, doubles the accumulation steps, redoes
the interrupted window, and ends with the same weights (relative update error <= 1e-5) and the same number of
optimizer steps as the unlimited large-batch run."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertForSequenceClassification

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from tests.parity_cases import flat_params, seq_cls_data, tiny_bert_config

RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated in backward)")


class MemoryLimitedBert(BertForSequenceClassification):
    """A BERT that "runs out of memory" above `max_rows` rows per forward/backward.

    `where="forward"`: raised in the forward pass. `where="backward"`: raised half-way through the backward pass
    (after the classifier and encoder gradients were already folded), and only from the second large call on, so
    the OOM hits the middle of a window."""

    max_rows = 8
    where = "forward"

    def __init__(self, config):
        super().__init__(config)
        self.large_calls = 0
        self.bert.embeddings.register_forward_hook(self._limit)

    def _limit(self, module, inputs, output):
        if not self.training or output.shape[0] <= self.max_rows:
            return output
        self.large_calls += 1
        if self.where == "forward":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate for {output.shape[0]} rows")
        return _RaiseInBackward.apply(output) if self.large_calls >= 2 else output


def _args(tmp_path, micro, steps, **overrides):
    return GradAccumArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **overrides,
    )


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_shrinks_micro_batch_and_keeps_the_large_batch_update(tmp_path, where):
    torch.manual_seed(0)
    config = tiny_bert_config(num_labels=3)
    limited = MemoryLimitedBert(config)
    limited.where = where
    reference_model = BertForSequenceClassification(config)
    reference_model.load_state_dict(limited.state_dict())
    w0 = flat_params(reference_model)
    data = seq_cls_data(256, torch.Generator().manual_seed(1))  # 4 optimizer steps of 64

    trainer = GradAccumTrainer(
        model=limited, args=_args(tmp_path / "oom", 32, 2, auto_find_batch_size=True), train_dataset=data
    )
    trainer.train()
    plan = trainer.accumulation_plan
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.effective_batch_size) == (8, 8, 64)

    reference = GradAccumTrainer(
        model=copy.deepcopy(reference_model), args=_args(tmp_path / "ref", 64, 1), train_dataset=data
    )
    reference.train()
    assert trainer.state.global_step == reference.state.global_step == 4
    d, d_ref = flat_params(trainer.model) - w0, flat_params(reference.model) - w0
    err = float((d - d_ref).norm() / d_ref.norm())
    print(f"OOM in {where}: 32 x 2 -> 8 x 8, relative update error vs batch 64: {err:.2e}")
    assert err <= RTOL


def test_without_auto_find_batch_size_the_oom_propagates(tmp_path):
    torch.manual_seed(0)
    model = MemoryLimitedBert(tiny_bert_config(num_labels=3))
    data = seq_cls_data(64, torch.Generator().manual_seed(1))
    trainer = GradAccumTrainer(model=model, args=_args(tmp_path, 32, 2), train_dataset=data)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()


def test_oom_at_one_sample_gives_a_clear_error(tmp_path):
    torch.manual_seed(0)
    model = MemoryLimitedBert(tiny_bert_config(num_labels=3))
    model.max_rows = 0
    data = seq_cls_data(16, torch.Generator().manual_seed(1))
    # The rule named and left unchecked: the first window's measurement would run out of memory first (below).
    args = _args(tmp_path, 4, 2, auto_find_batch_size=True, loss_normalisation="rows",
                 check_declared_normalisation=False)  # fmt: skip
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data)
    with pytest.raises(RuntimeError, match="below 1 sample"):
        trainer.train()


def test_the_measurement_halves_its_cuts_out_of_memory_and_stops_if_nothing_fits(tmp_path):
    """The first window's measurement retries cuts of half as many rows after an out-of-memory error (a micro-batch
    of 16 where only 8 rows fit: measured, trained). Where even two rows do not fit, nothing is measured, and the rules
    in play weigh the window differently: it stops before the first step, saying so."""
    from hf_gradaccum.losses.model_losses import ModelLossError

    torch.manual_seed(0)
    model = MemoryLimitedBert(tiny_bert_config(num_labels=3))
    data = seq_cls_data(32, torch.Generator().manual_seed(1))
    trainer = GradAccumTrainer(model=model, args=_args(tmp_path / "fits", 16, 2), train_dataset=data)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()  # training's own micro-batch of 16 does not fit; the measurement did
    finding = json.loads((tmp_path / "fits" / "accumulation_check.json").read_text())["loss_normalisation"]
    assert finding["decided_by"] in ("values", "tie") and finding["cuts"] >= 2
    model.max_rows = 0
    start = [p.detach().clone() for p in model.parameters()]
    trainer = GradAccumTrainer(model=model, args=_args(tmp_path / "none", 4, 2), train_dataset=data)
    with pytest.raises(ModelLossError, match="the probe ran out of memory even on cuts of two rows"):
        trainer.train()
    assert all(torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))


def _worker(tmp_path, name, micro, steps, limit_mb):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "tests.workers.oom_worker", "--micro", str(micro), "--steps", str(steps)]
    cmd += ["--limit_mb", str(limit_mb), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


def test_real_cpu_allocation_failure_under_address_space_limit(tmp_path):
    """A subprocess under RLIMIT_AS (150 MiB above its size at start): the CPU allocator really fails for 32 rows
    of a model whose activations are 8 MiB per sample; training completes at a smaller micro-batch, with the update
    of the unlimited batch-64 run."""
    limited, log = _worker(tmp_path, "limited", 32, 2, limit_mb=150)
    assert "Out of memory" in log
    assert limited["micro_batch_chunk_size"] is not None and limited["micro_batch_chunk_size"] < 32
    micro, steps = limited["plan"]
    assert micro * steps == 64
    unlimited, _ = _worker(tmp_path, "unlimited", 64, 1, limit_mb=0)
    assert limited["global_step"] == unlimited["global_step"] == 2
    d, d_ref = torch.tensor(limited["update"]), torch.tensor(unlimited["update"])
    err = float((d - d_ref).norm() / d_ref.norm())
    print(f"real CPU OOM: micro-batch 32 -> {micro} ({micro} x {steps}); relative update error vs batch 64: {err:.2e}")
    assert err <= RTOL


def test_engine_window_retry_in_a_plain_loop_keeps_the_large_batch_update():
    """`WindowOOMRetry` without a Trainer: a layer that really fails to allocate (the CPU allocator refuses
    `rows * 2**41` bytes) above 2 rows; the window of 2 micro-batches of 4 is redone in chunks of 2 and its update
    equals one step on the batch of 8."""
    from hf_gradaccum import GradientAccumulator, WindowOOMRetry

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    reference = copy.deepcopy(model)

    def hungry(module, inputs, output):
        if output.shape[0] > 2:
            torch.empty(output.shape[0] << 41, dtype=torch.uint8)

    model[1].register_forward_hook(hungry)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    window = [{"x": x[:4], "y": y[:4]}, {"x": x[4:], "y": y[4:]}]
    acc = GradientAccumulator(model, gradient_accumulation_steps=2)
    retry = WindowOOMRetry()

    def micro_step(batch):
        for chunk in retry.chunks(batch):
            loss = torch.nn.functional.mse_loss(model(chunk["x"]), chunk["y"])
            acc.backward(loss, num_items=len(chunk["x"]))

    for i in range(len(window)):
        with acc.accumulate(model):
            retry.run(acc, window, i, micro_step)
    assert acc.finish_window().applied and retry.chunk_size == 2
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=1e-7)


def test_engine_window_retry_gives_up_at_one_sample():
    from hf_gradaccum import GradientAccumulator, WindowOOMRetry
    from hf_gradaccum.engine.oom_retry import MicroBatchTooSmallError

    model = torch.nn.Linear(3, 1)
    acc = GradientAccumulator(model, gradient_accumulation_steps=1)

    def always_oom(batch):
        torch.empty(1 << 44, dtype=torch.uint8)

    with pytest.raises(MicroBatchTooSmallError, match="below 1 sample"):
        with acc.accumulate(model):
            WindowOOMRetry().run(acc, [{"x": torch.zeros(4, 3)}], 0, always_oom)
