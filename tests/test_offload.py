"""`offload_accumulation_buffer=True`: the accumulation buffer in host memory (`engine/offload.py`). On the CPU the
host is also the "device", so these tests run the whole staged path (slots, the host fold thread, the window end)
without a GPU; `benchmarks/gpu_check.py` runs the CUDA copies. Tolerances: 1e-5 relative against the hand-computed
large batch (fp32), and 1e-6 relative against the same run with the buffer on the device."""

import copy
import json

import pytest
import torch

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator
from hf_gradaccum.engine.offload import OffloadedGradientBuffers
from tests.multiprocess import launch
from tests.parity_cases import CASES, flat_params, large_batch_reference, relative_update_error, train_with
from tests.test_mixed_precision import OVERFLOW_SAMPLE, _fp16_trainer, _regression_window

CASE_BY_NAME = {c.name: c for c in CASES}
RTOL = 1e-5
SAME_UPDATE_RTOL = 1e-6


class OffloadArguments(GradAccumArguments):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, offload_accumulation_buffer=True, **kwargs)


@pytest.mark.parametrize("case_name", ["bert_seq_cls", "gpt2_causal_lm"])
def test_trainer_with_offloaded_buffer_matches_large_batch_and_device_buffer(case_name, tmp_path):
    case = CASE_BY_NAME[case_name]
    n, micro, steps = 10, 2, 3  # two windows, the second partial
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(n, torch.Generator().manual_seed(1))
    offloaded, trainer = train_with(
        GradAccumTrainer, case, model, data, micro, steps, str(tmp_path / "off"), args_cls=OffloadArguments
    )
    assert isinstance(trainer.accumulator.buffers, OffloadedGradientBuffers)
    on_device, _ = train_with(GradAccumTrainer, case, model, data, micro, steps, str(tmp_path / "dev"))
    windows = [list(range(i, min(i + micro * steps, n))) for i in range(0, n, micro * steps)]
    reference = large_batch_reference(case, model, data, windows)
    err = relative_update_error(model, offloaded, reference)
    same = relative_update_error(model, offloaded, on_device)
    print(f"{case_name} offloaded: vs large batch {err:.2e}, vs device buffer {same:.2e}")
    assert err <= RTOL
    assert same <= SAME_UPDATE_RTOL


def test_offloaded_bf16_parameters_keep_an_fp32_host_buffer():
    """bf16 parameters: the host buffer is fp32 and the gradient returns in bf16, equal to the device fp32 buffer's
    (the same adds in the same order, on the host instead of the device)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(torch.bfloat16)
    x, y = torch.randn(24, 16, dtype=torch.bfloat16), torch.randint(0, 4, (24,))
    grads = {}
    for offload in (False, True):
        acc = GradientAccumulator(copy.deepcopy(model), 8, offload_accumulation_buffer=offload)
        for k in range(8):
            rows = slice(3 * k, 3 * k + 3)
            loss = torch.nn.functional.cross_entropy(acc._model(x[rows]).float(), y[rows])
            acc.backward(loss, num_items=3)
        assert acc.finish_window().applied
        assert all(b.dtype == torch.float32 for b in acc.buffers.flat.values())
        assert all(p.grad.dtype == torch.bfloat16 for p in acc.parameters)
        grads[offload] = [p.grad.clone() for p in acc.parameters]
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)


def test_offloaded_fp16_recompute_redoes_only_the_overflowing_micro_batch(tmp_path):
    """fp16 loss scaling with the buffer on the host: the overflowing micro-batch's gradients are checked in `.grad`
    before any of them is staged, redone at the backed-off scale, and the update equals the device buffer's."""
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_regression"].make_model()
    data = _regression_window(overflow=True)
    assert OVERFLOW_SAMPLE < len(data)
    runs = {}
    for offload in (False, True):
        trainer = _fp16_trainer(tmp_path / str(offload), model, data, offload_accumulation_buffer=offload)
        trainer.train()
        acc = trainer.accumulator
        assert isinstance(acc.buffers, OffloadedGradientBuffers) == offload
        assert acc.applied_steps == 1 and acc.recomputed_micro_batches == 1
        runs[offload] = trainer.model
    err = relative_update_error(model, runs[True], runs[False])
    print(f"fp16 recompute, offloaded vs device buffer: {err:.2e}")
    assert err <= SAME_UPDATE_RTOL


def test_offloaded_buffer_resumes_mid_window():
    """A mid-window checkpoint of the host buffer, restored into a fresh accumulator, ends in the same update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    batches = [(torch.randn(k + 1, 8), torch.randint(0, 3, (k + 1,))) for k in range(4)]

    def run(acc, subset):
        for x, y in subset:
            acc.backward(torch.nn.functional.cross_entropy(acc._model(x), y), num_items=len(y))

    whole = GradientAccumulator(copy.deepcopy(model), 4, offload_accumulation_buffer=True)
    run(whole, batches)
    whole.finish_window()
    first = GradientAccumulator(copy.deepcopy(model), 4, offload_accumulation_buffer=True)
    run(first, batches[:2])
    state = first.state_dict()
    resumed = GradientAccumulator(copy.deepcopy(model), 4, offload_accumulation_buffer=True)
    resumed.load_state_dict(state)
    run(resumed, batches[2:])
    resumed.finish_window()
    for a, b in zip(whole.parameters, resumed.parameters, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=SAME_UPDATE_RTOL, atol=0)


@pytest.mark.parametrize("how", ["true", "chunked"])
def test_plain_loop_under_ddp_with_offloaded_buffer_matches_large_batch(how, tmp_path):
    """2 gloo processes: the host buffers summed over the ranks on the host (gloo reduces host memory), or through
    the device in chunks of 1000 elements (what a process group without a CPU backend, NCCL, gets)."""
    launch("plain_loop_parity", "bert_seq_cls", str(tmp_path), how)
    params = flat_params(CASE_BY_NAME["bert_seq_cls"].make_model()).numel()
    for rank in (0, 1):
        record = json.loads((tmp_path / f"bert_seq_cls_rank{rank}.json").read_text())
        print(f"offloaded DDP ({how}) rank {rank}: relative update error {record['err']:.2e}, {record}")
        assert record["err"] <= RTOL
        assert record["flat_buffer_reductions_ours"] == 1
        chunks = 1 if how == "true" else -(-params // 1000)
        assert record["collectives_ours"] == chunks + 1  # the buffer's, and the window's statistics


def test_offload_is_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="offload_accumulation_buffer.*True or False"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, offload_accumulation_buffer="yes")
    with pytest.raises(ValueError, match="offload_accumulation_buffer.*True or False"):
        GradAccumArguments(str(tmp_path), use_cpu=True, offload_accumulation_buffer="yes")


def test_trainer_argument_reaches_the_accumulator(tmp_path):
    args = GradAccumArguments(str(tmp_path), use_cpu=True, offload_accumulation_buffer=True, report_to=[])
    torch.manual_seed(0)
    model = CASE_BY_NAME["bert_seq_cls"].make_model()
    trainer = GradAccumTrainer(model=model, args=args)
    acc = trainer.create_accumulator(model)
    assert isinstance(acc.buffers, OffloadedGradientBuffers)
    assert flat_params(model).numel() == sum(b.numel() for b in acc.buffers.flat.values())


def test_removing_the_hooks_stops_the_host_thread():
    """A Trainer that rebuilds its accumulator (a re-wrapped model) must not leave a thread behind per rebuild."""
    import threading

    def fold_threads():
        return [t for t in threading.enumerate() if t.name == "hf_gradaccum-offload-fold"]

    before = len(fold_threads())
    acc = GradientAccumulator(torch.nn.Linear(4, 2), 2, offload_accumulation_buffer=True)
    assert len(fold_threads()) == before + 1
    acc.remove_hooks()
    acc.buffers._folder._thread.join(timeout=10)
    assert len(fold_threads()) == before
