"""The CUDA paths: GradAccumTrainer on a GPU in fp32, fp16 through Accelerate's native autocast with this project's
loss scaling, bf16 parameters with fp32 buffers, a real CUDA out-of-memory error under a capped allocator, and
GradAccumTrainer under Accelerate's FSDP2 plugin with NCCL, the offloaded buffer, and the coupled-loss and MoE window
modes. Skipped without a GPU (CI has none); the results of the
last GPU run are in docs/limits.md. References are computed on the CPU in fp32 from the same initial weights."""

import copy
import json
import os
import subprocess
import sys

import datasets
import pytest
import torch
from harness.arms import apply_memory_limit
from transformers import BertConfig, BertForSequenceClassification

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from tests.multiprocess import ROOT, free_port
from tests.parity_cases import CASES, LAYOUTS, large_batch_reference, relative_update_error, train_with
from tests.test_mixed_precision import _bf16_gradient_errors, _fp16_trainer, _regression_window

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASE_BY_NAME = {c.name: c for c in CASES}
RTOL = 1e-5


@pytest.fixture(autouse=True)
def exact_cuda_matmuls():
    # Parity in fp32 needs fp32 matmuls: TF32 would round the inputs to 10 mantissa bits.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("case_name", ["bert_seq_cls", "gpt2_causal_lm", "resnet_groupnorm_image_cls"])
def test_trainer_on_cuda_matches_large_batch(case_name, tmp_path):
    case = CASE_BY_NAME[case_name]
    n, micro, steps = LAYOUTS["partial_last_window"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(n, torch.Generator().manual_seed(1))
    trained, trainer = train_with(GradAccumTrainer, case, model, data, micro, steps, str(tmp_path), use_cpu=False)
    assert trainer.args.device.type == "cuda"
    windows = [list(range(i, min(i + micro * steps, n))) for i in range(0, n, micro * steps)]
    err = relative_update_error(model, trained.cpu(), large_batch_reference(case, model, data, windows))
    print(f"CUDA fp32 {case_name}: relative update error {err:.2e}")
    assert err <= RTOL


def test_fp16_native_autocast_recomputes_only_the_overflowing_micro_batch(tmp_path):
    """Accelerate's CUDA fp16 autocast with the accumulator's loss scaler: the injected overflow (one micro-batch of
    four) is recomputed at the backed-off scale and the update agrees with a window that never overflows."""
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_regression"].make_model()
    data = _regression_window(overflow=True)
    trainer = _fp16_trainer(tmp_path / "recompute", model, data, overflow_policy="recompute", use_cpu=False)
    assert trainer.accelerator.native_amp and trainer.args.device.type == "cuda"
    trainer.train()
    acc = trainer.accumulator
    assert trainer.state.global_step == 1 and acc.applied_steps == 1
    assert acc.recomputed_micro_batches == 1
    clean = _fp16_trainer(tmp_path / "clean", model, data, loss_scale_init=acc.loss_scaler.scale, use_cpu=False)
    clean.train()
    assert clean.accumulator.loss_scaler.num_overflows == 0
    w0 = torch.cat([p.detach().flatten().double() for p in model.parameters()])

    def delta(m):
        return torch.cat([p.detach().cpu().flatten().double() for p in m.parameters()]) - w0

    err = float((delta(trainer.model) - delta(clean.model)).norm() / delta(clean.model).norm())
    print(f"CUDA fp16: {acc.loss_scaler.num_overflows} backoffs, relative update error vs clean window {err:.2e}")
    assert err <= 5e-3


@pytest.mark.parametrize("num_micro", [64, 256])
def test_bf16_parameters_fp32_buffers_keep_one_pass_precision_on_cuda(num_micro):
    one_pass, stock, ours = _bf16_gradient_errors(num_micro, seed=0, device="cuda")
    print(
        f"CUDA bf16 {num_micro}: one pass {one_pass:.2e}, stock x{stock / one_pass:.2f}, ours x{ours / one_pass:.2f}"
    )
    assert ours <= 1.25 * one_pass


def _long_sequence_data(n: int, seq_len: int) -> datasets.Dataset:
    g = torch.Generator().manual_seed(3)
    return datasets.Dataset.from_dict(
        {
            "input_ids": torch.randint(5, 1000, (n, seq_len), generator=g).tolist(),
            "attention_mask": torch.ones(n, seq_len, dtype=torch.long).tolist(),
            "labels": torch.randint(0, 2, (n,), generator=g).tolist(),
        }
    )


def test_real_cuda_out_of_memory_halves_the_micro_batch_and_keeps_the_update(tmp_path):
    """A capped CUDA allocator (the recipes' `max_memory_mb`: 1.6x the peak of one bare forward/backward of 8 rows)
    that cannot hold a micro-batch of 32: the first forward/backward raises a real `torch.OutOfMemoryError`,
    `auto_find_batch_size` halves the micro-batch and doubles the accumulation steps until it fits, and the update
    still equals the large batch of 32."""
    config = BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    data = _long_sequence_data(64, 512)
    device = torch.device("cuda")

    # Calibrate the cap on a copy: the peak of one micro-batch of 8 rows.
    probe = copy.deepcopy(model).to(device)
    torch.cuda.reset_peak_memory_stats()
    batch = {k: torch.tensor(data[:8][k], device=device) for k in data.column_names}
    probe(**batch).loss.backward()
    peak8 = torch.cuda.max_memory_allocated() / 2**20
    del probe, batch
    torch.cuda.empty_cache()
    cap_mb = 1.6 * peak8
    print(apply_memory_limit(cap_mb, device))
    try:
        args = GradAccumArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=32, gradient_accumulation_steps=1,
            learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, num_train_epochs=1,
            train_sampling_strategy="sequential", report_to=[], save_strategy="no", logging_steps=1,
            auto_find_batch_size=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = GradAccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)
        trainer.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    oom_logs = [h for h in trainer.state.log_history if "oom/micro_batch_size" in h]
    print(f"CUDA OOM: cap {cap_mb:.0f} MiB (peak of 8 rows: {peak8:.0f} MiB); micro-batch steps: {oom_logs}")
    assert oom_logs and trainer.micro_batch_chunk_size < 32
    assert trainer.state.global_step == 2 and trainer.accumulator.applied_steps == 2
    case = CASE_BY_NAME["bert_seq_cls"]
    reference = large_batch_reference(case, model, data, [list(range(32)), list(range(32, 64))])
    err = relative_update_error(model, trainer.model.cpu(), reference)
    print(f"CUDA OOM: micro-batch {trainer.micro_batch_chunk_size}, relative update error {err:.2e}")
    assert err <= RTOL


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_trainer_under_accelerate_fsdp2_on_cuda(mixed_precision, tmp_path):
    """`accelerate launch --config_file configs/accelerate/fsdp2.yaml` (Accelerate's own FSDP2 set-up, NCCL) on the
    GPUs there are: fp32 parity with the large batch (clipped and not), a bitwise resume from the sharded
    checkpoint; with bf16, the reduction raised to fp32 and the update within bf16 tolerance."""
    world = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/fsdp2.yaml"]
    cmd += [
        "--num_processes",
        str(world),
        "--mixed_precision",
        mixed_precision,
        "--main_process_port",
        str(free_port()),
    ]
    cmd += ["tests/workers/run_ddp.py", "trainer_fsdp2", "bert_token_cls", str(tmp_path)]
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    record = json.loads((tmp_path / "fsdp2_trainer_rank0.json").read_text())
    print(f"CUDA FSDP2 ({world} GPU, {mixed_precision}):", record)
    assert record["resume_bitwise"] is True
    if mixed_precision == "no":
        assert record["err_plain"] <= RTOL and record["err_clipped"] <= RTOL
    else:
        assert record["reduce_dtype"] == "torch.float32"
        assert record["err_plain"] <= 2e-2  # bf16 compute


class _OffloadArguments(GradAccumArguments):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, offload_accumulation_buffer=True, **kwargs)


@pytest.mark.parametrize("case_name", ["bert_seq_cls", "gpt2_causal_lm"])
def test_offloaded_buffer_on_cuda_matches_large_batch(case_name, tmp_path):
    """The buffer in pinned host memory, gradients copied out on a side stream as autograd produces them: the same
    update as the large batch (fp32, TF32 off) and as the buffer on the GPU."""
    case = CASE_BY_NAME[case_name]
    n, micro, steps = LAYOUTS["partial_last_window"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(n, torch.Generator().manual_seed(1))
    offloaded, trainer = train_with(
        GradAccumTrainer, case, model, data, micro, steps, str(tmp_path / "off"), use_cpu=False,
        args_cls=_OffloadArguments,
    )  # fmt: skip
    flats = trainer.accumulator.buffers.flat.values()
    assert all(b.device.type == "cpu" and b.is_pinned() for b in flats)
    on_device, _ = train_with(GradAccumTrainer, case, model, data, micro, steps, str(tmp_path / "dev"), use_cpu=False)
    windows = [list(range(i, min(i + micro * steps, n))) for i in range(0, n, micro * steps)]
    err = relative_update_error(model, offloaded.cpu(), large_batch_reference(case, model, data, windows))
    same = relative_update_error(model, offloaded.cpu(), on_device.cpu())
    print(f"CUDA offloaded {case_name}: vs large batch {err:.2e}, vs GPU buffer {same:.2e}")
    assert err <= RTOL and same <= 1e-6


def test_offloaded_buffer_holds_no_gradient_on_cuda_between_micro_batches():
    """bf16 parameters: after each micro-batch's backward the GPU holds no more than one layer's gradient (the stock path holds a bf16
    `.grad`, the GPU buffer 4 bytes per parameter), and the mean gradient equals the GPU buffer's."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]
    model = torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)
    x = torch.randn(8, 16, 1024, device="cuda", dtype=torch.bfloat16)
    grads, held = {}, {}
    for offload in (False, True):
        m = copy.deepcopy(model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        acc = GradientAccumulator(m, 8, offload_accumulation_buffer=offload)
        held[offload] = []
        for k in range(8):
            acc.backward(m(x[k]).float().pow(2).mean(), num_items=16)
            torch.cuda.synchronize()
            held[offload].append(torch.cuda.memory_allocated() - before)
        assert acc.finish_window().applied
        grads[offload] = torch.cat([p.grad.float().flatten() for p in m.parameters()])
    params = sum(p.numel() for p in model.parameters())
    print(f"GPU bytes held per parameter between micro-batches: GPU buffer {max(held[False]) / params:.2f}, "
          f"offloaded {max(held[True]) / params:.2f}")  # fmt: skip
    assert max(held[False]) >= 4 * params
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert max(held[True]) <= largest  # at most about one layer's gradient (the window's small statistics)
    err = float((grads[True] - grads[False]).norm() / grads[False].norm())
    assert err <= 1e-6


@pytest.mark.parametrize("case", ["clip", "ranking"])
def test_trainer_coupled_mode_on_cuda_matches_large_batch(case, tmp_path):
    """The coupled-loss mode on the GPU, dropout on: pass 2 recomputes pass 1 bitwise from the saved CUDA RNG states,
    and the step equals the large batch's one graph over the same masks (computed on the GPU from those states)."""
    from tests.test_coupled_trainer import _args, _rows, _update
    from tests.workers.coupled_cases import CASES as COUPLED_CASES
    from tests.workers.coupled_cases import reference_gradient, relative_error

    torch.manual_seed(0)
    model, coupled, _ = COUPLED_CASES[case](0.1, check_recompute=True)
    model0 = copy.deepcopy(model)
    trainer = GradAccumTrainer(
        model=model, args=_args(tmp_path, use_cpu=False), train_dataset=_rows(case), coupled_loss=coupled
    )
    trainer.train()
    assert trainer.args.device.type == "cuda"
    window = coupled.last_window
    assert window.recompute_max_abs_diff == [0.0, 0.0, 0.0]
    reference = reference_gradient(model0.to("cuda"), coupled, trainer.coupled_mode.batches, window.rng_states)
    err = relative_error(_update(model0.cpu(), trainer.model.cpu()), -reference.cpu())
    print(f"CUDA coupled mode {case}: relative update error {err:.2e}")
    assert err <= RTOL


def test_trainer_moe_window_mode_on_cuda_matches_large_batch(tmp_path):
    """Window-level MoE load balancing on the GPU (tiny Mixtral, uneven padded micro-batches and windows) against one
    SGD step per window on the whole window as one batch, computed on the GPU."""
    from tests.composition_cases import (
        NUM_SAMPLES,
        TRAIN_ARGS,
        sgd_reference,
        tiny_mixtral,
        train_and_collect,
        update_error,
    )
    from tests.test_moe_balance import _collate, _rows, large_batch_loss

    def on_gpu_loss(model, window):
        return large_batch_loss(model, [{k: v.to("cuda") for k, v in b.items()} for b in window])

    errors = {}
    for mode in ("window", "micro_batch"):
        torch.manual_seed(0)
        args = GradAccumArguments(str(tmp_path / mode), moe_load_balance=mode, **{**TRAIN_ARGS, "use_cpu": False})
        trainer, windows, initial, start = train_and_collect(
            GradAccumTrainer, args, model=tiny_mixtral(), train_dataset=_rows(NUM_SAMPLES), data_collator=_collate
        )
        assert trainer.args.device.type == "cuda"
        errors[mode] = update_error(initial, trainer.model, sgd_reference(start, windows, on_gpu_loss))
    print(f"CUDA MoE: relative update error, window {errors['window']:.2e}, micro_batch {errors['micro_batch']:.2e}")
    assert errors["window"] <= RTOL
    assert errors["micro_batch"] > 100 * errors["window"]
