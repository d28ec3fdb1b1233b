"""The overlapped DDP reduction (`engine/overlap.py`): buckets of the flat buffer all-reduced during the last
micro-batch's backward give the same weights as the window-end reduction (bitwise, 2 gloo processes) and as the
hand-computed large batch (1e-5 relative), with unused parameters, partial windows, a NaN loss on one rank and an
fp16 overflow recomputed on one rank."""

import json

import pytest
import torch

from hf_gradaccum import GradientAccumulator
from hf_gradaccum.engine.buffers import FlatGradientBuffers
from hf_gradaccum.engine.overlap import assign_buckets
from tests.multiprocess import launch
from tests.workers import overlap_ddp

RTOL = 1e-5


def test_buckets_are_contiguous_reverse_order_slices_with_a_small_first_one():
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(16)))  # 32 tensors, 0.25 MiB weights
    buffers = FlatGradientBuffers(list(model.parameters()), torch.float32)
    buckets = assign_buckets(buffers, bucket_cap_mb=2)
    order = [i for b in buckets for i in b.params]
    assert order == list(reversed(range(32)))  # reverse registration order, every parameter once
    for b in buckets:
        starts = sorted(buffers.views[i].storage_offset() for i in b.params)
        assert (b.start, b.end) == (starts[0], starts[-1] + buffers.views[b.params[0]].numel())
        assert b.end - b.start == sum(buffers.views[i].numel() for i in b.params)  # one contiguous slice
    mib = [(b.end - b.start) * 4 / 2**20 for b in buckets]
    # DDP's rule: close a bucket once it holds the cap; the first one's cap is 1 MB so communication starts early.
    assert len(buckets) == 3 and 1 <= mib[0] < 1.1 and 2 <= mib[1] < 2.1 and mib[2] < 2


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "25", True])
def test_bad_bucket_cap_is_refused(value):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, bucket_cap_mb=value)


def test_bad_overlap_flag_is_refused():
    with pytest.raises(ValueError, match="overlap_reduction"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, overlap_reduction="yes")


@pytest.mark.parametrize("kwargs", [{"overlap_reduction": "yes"}, {"ddp_bucket_cap_mb": -1}])
def test_bad_trainer_overlap_arguments_are_refused(kwargs):
    from hf_gradaccum import GradAccumArguments

    with pytest.raises(ValueError, match="overlap_reduction|bucket_cap_mb"):
        GradAccumArguments("out", use_cpu=True, report_to=[], **kwargs)


def test_one_process_has_no_overlap():
    assert GradientAccumulator(torch.nn.Linear(2, 2), 2)._overlap is None


def test_overlapped_reduction_equals_window_end_reduction_on_two_processes(tmp_path):
    launch(str(tmp_path), script="tests/workers/overlap_ddp.py")
    records = [json.loads((tmp_path / f"overlap_rank{r}.json").read_text()) for r in (0, 1)]
    for r in records:
        print(
            f"rank {r['rank']}: {r['buckets']} buckets; launched during backward per window "
            f"{r['launched_during_backward']}; bitwise equal to the window-end path {r['bitwise_equal_after_window']}; "
            f"rel. update error vs large batch {r['err_overlap']:.2e} (window end {r['err_window_end']:.2e}); "
            f"fp16 recompute: bitwise {r['fp16_bitwise_equal']}, scales {r['fp16_scales']}, recomputed "
            f"{r['fp16_recomputed']}, launched {r['fp16_launched_during_backward']} of {r['fp16_buckets']}"
        )
        buckets = r["buckets"]
        assert buckets >= 4 and r["no_overlap_object"]
        assert r["auto_overlap_on_cpu"] is False
        assert r["stop_overlapping"] == [True, True]
        # Every window: the same weights as the window-end reduction, bit for bit, and both ranks in step.
        assert all(r["bitwise_equal_after_window"]) and r["ranks_bitwise_equal"]
        assert r["err_overlap"] <= RTOL and r["err_window_end"] <= RTOL
        assert r["applied"] == [True, True, True, False, True, True]  # the NaN window is skipped on both ranks
        assert r["rare_unchanged"][2]  # no gradient anywhere in window 2: untouched, not zero-stepped
        assert r["collectives_per_window"] == [buckets + 1] * len(overlap_ddp.WINDOWS)
        assert r["fp16_bitwise_equal"] and r["fp16_scales"][0] == r["fp16_scales"][1]
    rank0, rank1 = records
    # The first bucket holds `rare`: a rank whose last micro-batch does not use it launches everything at the end,
    # one whose last micro-batch does launches every bucket during backward. Partial windows never overlap.
    assert rank0["launched_during_backward"][:3] == [0, buckets, 0]
    assert rank1["launched_during_backward"][:3] == [buckets, 0, 0]
    assert rank0["launched_during_backward"][4:] == [0, buckets] and rank1["launched_during_backward"][4:] == [0, 0]
    assert rank0["fp16_recomputed"] == [0, 0] and rank1["fp16_recomputed"] == [1, 1]
    assert (
        rank0["fp16_launched_during_backward"] == rank1["fp16_launched_during_backward"] == [rank0["fp16_buckets"]] * 2
    )
