"""HSDP and tensor parallelism by every route transformers and Accelerate offer, on real gloo CPU processes
(`tests/workers/hsdp_tp.py`): `GradAccumTrainer` at gradient accumulation 3 equals the hand-computed large batch on
the same samples (1e-5 relative) for a causal LM with rows of different lengths and a sequence classifier (on the FSDP2 routes also
with `fsdp_reduce_schedule="once_per_window"`), and the stock `Trainer`'s error on the same run is recorded. Two launches: 2 ranks (tensor parallelism) and 4 ranks (HSDP,
tensor parallelism x FSDP2); each trains every route and both trainers in one process group. The same launches
also train TRL's `SFTTrainer` composed with ours and a PEFT LoRA model under HSDP and tensor parallelism.

On CPU, Accelerate refuses a `ParallelismConfig` and FSDP by device checks alone; the worker lifts exactly those
(`lift_accelerate_device_checks`, `use_accelerate_fsdp2_on_cpu`), and everything behind them runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.multiprocess import ROOT, free_port
from tests.torch_features import needs_fsdp2_torch, needs_once_per_window_internals

pytest.importorskip("transformers.distributed", reason="DistributedConfig needs a transformers with it")
# Run by the engine CI job (.ci/engines), not by `make test`: 2- and 4-process launches.
pytestmark = [needs_fsdp2_torch, pytest.mark.engines]

RTOL = 1e-5
STEPS = 3  # gradient_accumulation_steps in the worker
TWO_RANK_ROUTES = ("tp", "tp_plan_auto", "pc_tp")
FOUR_RANK_ROUTES = ("hsdp", "tp_fsdp", "pc_hsdp")
ONCE_PER_WINDOW_REFUSED = needs_once_per_window_internals.args[0]


def torchrun(ranks: int, out: Path, *routes: str) -> dict[str, dict]:
    """One `torchrun` launch of the worker for `routes`; returns rank 0's record per route."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "tests/workers/hsdp_tp.py", str(out)]
    proc = subprocess.run([*cmd, *routes], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return {route: json.loads((out / f"{route}.json").read_text()) for route in routes}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict]:
    return torchrun(2, tmp_path_factory.mktemp("tp"), *TWO_RANK_ROUTES, "tp_bf16")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict[str, dict]:
    return torchrun(4, tmp_path_factory.mktemp("hsdp"), *FOUR_RANK_ROUTES, "engine_tp_dp")


def check_exact(record: dict, trainers: tuple[str, ...] = ("ours",)) -> None:
    for model in ("causal_lm", "seq_cls"):
        for trainer in trainers:
            ours = record[f"{model}/{trainer}"]
            assert isinstance(ours, float) and ours <= RTOL, (record["route"], model, trainer, ours)
            layout = record[f"{model}/{trainer}/layout"]
            # fp32 accumulation on each rank's shards only: the buffer is exactly the local parameters.
            assert layout["buffer_dtype"] == "torch.float32"
            assert layout["buffer_numel"] == layout["local_numel"] < layout["full_numel"]


def check_fsdp_schedules(record: dict) -> None:
    """FSDP2 routes: by default one reduce-scatter per FSDP2 group and micro-batch into the fp32 buffer; with
    `fsdp_reduce_schedule="once_per_window"` one per group and window, the update the same. The accumulator's own
    window-end exchange is one all-reduce of the window's statistics (the gradients are FSDP2's)."""
    if ONCE_PER_WINDOW_REFUSED:  # this torch lacks the FSDP2 internals the schedule reads
        check_exact(record)
        assert "relies on FSDP2 internals" in record["causal_lm/ours_once_per_window"]
        return
    check_exact(record, ("ours", "ours_once_per_window"))
    for model in ("causal_lm", "seq_cls"):
        every, once = record[f"{model}/ours/layout"], record[f"{model}/ours_once_per_window/layout"]
        assert 0 < once["reduce_scatters"] <= once["fsdp_modules"], once
        assert every["reduce_scatters"] == STEPS * once["reduce_scatters"], (every, once)
        assert every["window_reductions"] == every["window_collectives"] == 1, every


def check_stock(record: dict, data_parallel_ranks: int) -> None:
    """The stock Trainer on the same run: exact for the causal LM (its loss takes `num_items_in_batch`), but the
    classifier's loss ignores it, so each micro-batch's mean is summed undivided and every data-parallel rank's
    gradient added: the update is `STEPS * data_parallel_ranks` times the large batch's."""
    assert record["causal_lm/stock"] <= RTOL, record
    assert record["seq_cls/stock"] == pytest.approx(STEPS * data_parallel_ranks - 1, rel=1e-4), record


@pytest.mark.parametrize("route", TWO_RANK_ROUTES)
def test_tensor_parallel_matches_large_batch(two_ranks, route):
    """`DistributedConfig(tp_size=2)`, `tp_plan="auto"`, and Accelerate's `ParallelismConfig(tp_size=2)`: both ranks
    see the same batch, so nothing is summed over ranks; the vocabulary-sharded embedding's replicated gradient is
    folded as its shard, and the norm weights (plain tensors on both ranks) keep their local gradient."""
    record = two_ranks[route]
    check_exact(record)
    for model in ("causal_lm", "seq_cls"):
        layout = record[f"{model}/ours/layout"]
        assert layout["meshes"] == ["tp"] and layout["buffers"] == "TensorParallelGradientBuffers", layout
        assert layout["window_collectives"] == 0, layout  # no rank has a data-parallel peer: nothing to sum
    check_stock(record, data_parallel_ranks=1)


def test_tensor_parallel_bf16_parameters_accumulate_in_fp32(two_ranks):
    """bf16 parameters under `DistributedConfig(tp_size=2)`, 64 micro-batches of one row: the gradient
    `GradAccumTrainer` steps with (each rank's shards summed in fp32, rounded to bf16 once) stays within 1.25x the
    error of one bf16 pass over all rows (both vs fp64). The stock Trainer's, summed in the bf16 `.grad`, does not:
    the check is sensitive enough to see bf16 accumulation (measured 5.2e-3 ours, 8.7e-3 stock, 5.6e-3 one pass)."""
    record = two_ranks["tp_bf16"]
    assert record["ours"] <= 1.25 * record["one_pass"], record
    assert record["stock"] > 1.25 * record["one_pass"], record


def test_tensor_parallel_refuses_what_it_cannot_run(two_ranks):
    refused = two_ranks["tp"]["refused"]
    assert "`verify_accumulation` is not supported under FSDP2 or tensor parallelism" in refused["verify"]
    assert "`auto_find_batch_size=True` is not supported under FSDP2 (or tensor parallelism)" in refused["oom_retry"]
    assert "`fsdp_reduce_schedule='once_per_window'` needs FSDP2" in refused["once_per_window"]


@pytest.mark.parametrize(("route", "mesh"), [("hsdp", "dp_replicate,fsdp"), ("pc_hsdp", "dp_replicate,dp_shard_cp")])
def test_hsdp_matches_large_batch(four_ranks, route, mesh):
    """HSDP, 2 replicas x 2 shards, through `DistributedConfig(dp_replicate_size=2, fsdp_size=2)` and through
    Accelerate's `ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)` with its FSDP2 plugin: reduce-scatter in
    a replica and all-reduce across replicas both sum into the sharded fp32 buffer."""
    record = four_ranks[route]
    check_fsdp_schedules(record)
    for model in ("causal_lm", "seq_cls"):
        layout = record[f"{model}/ours/layout"]
        assert layout["meshes"] == [mesh] and layout["placements"] == ["Replicate,Shard"], layout
        assert layout["buffers"] == "ShardedGradientBuffers"
        assert 2 * layout["local_numel"] <= 1.1 * layout["full_numel"]  # half the model per rank (fsdp_size=2)
    check_stock(record, data_parallel_ranks=4)


def test_tensor_parallel_with_fsdp2_matches_large_batch(four_ranks):
    """`DistributedConfig(tp_size=2, fsdp_size=2)`: the window's items are summed over the 2 data-parallel ranks
    only (summed over all 4, each batch would count twice and the update would be half the large batch's)."""
    record = four_ranks["tp_fsdp"]
    check_fsdp_schedules(record)
    for model in ("causal_lm", "seq_cls"):
        layout = record[f"{model}/ours/layout"]
        assert "fsdp,tp" in layout["meshes"] and layout["buffers"] == "ShardedGradientBuffers", layout
        assert 4 * layout["local_numel"] <= 1.1 * layout["full_numel"]  # a quarter of the model per rank
    check_stock(record, data_parallel_ranks=2)
    assert "pass `data_parallel_group`" in record["refused"]["engine_without_group"]


def test_plain_engine_tensor_parallel_with_data_parallel_group(four_ranks):
    """`GradientAccumulator(model, data_parallel_group=mesh["dp"].get_group())` on a 2 x 2 (`dp`, `tp`) mesh without
    FSDP2: each window's items are the 15 rows of the two data-parallel ranks (not 30: each counted once, not once
    per tensor-parallel rank), and the window costs one all-reduce of the buffer and one of the statistics."""
    record = four_ranks["engine_tp_dp"]
    assert record["relative_update_error"] <= RTOL, record
    assert record["num_items"] == 15 and record["buffers"] == "TensorParallelGradientBuffers", record
    assert record["window_collectives"] == 2, record


def test_hsdp_sharded_at_load_time_refuses_once_per_window_with_fp16_recompute(four_ranks):
    """As under Accelerate's FSDP2 plugin: FSDP2 sums the window's unsharded gradients itself, so one overflowing
    micro-batch could not be redone alone."""
    refused = four_ranks["hsdp"]["refused"]
    assert "with fp16 needs `overflow_policy='skip'`" in refused["once_per_window_fp16_recompute"]


@pytest.mark.parametrize(
    ("route", "case", "mesh", "buffers"),
    [
        ("hsdp", "sft", "dp_replicate,fsdp", "ShardedGradientBuffers"),
        ("tp", "sft", "tp", "TensorParallelGradientBuffers"),
        ("pc_hsdp", "lora", "dp_replicate,dp_shard_cp", "ShardedGradientBuffers"),
        ("tp", "lora", "tp", "TensorParallelGradientBuffers"),
    ],
)
def test_composed_sft_and_lora_match_large_batch(two_ranks, four_ranks, route, case, mesh, buffers):
    """`class SFTGradAccum(GradAccumTrainer, SFTTrainer)` on the causal LM's rows (unpadded; TRL's collator pads
    them) and a PEFT LoRA model (q/v projections): ours equals the large batch, and so does the stock trainer (both
    losses take `num_items_in_batch`). Under HSDP the LoRA model is the one Accelerate's FSDP2 plugin shards (the
    adapters are `DTensor`s like the base weights); under tensor parallelism PEFT lays `lora_B` out on the `tp` mesh
    and `lora_A` stays a plain tensor on both ranks."""
    record = (two_ranks if route == "tp" else four_ranks)[route]
    for trainer in ("stock", "ours"):
        assert isinstance(record[f"{case}/{trainer}"], float), record[f"{case}/{trainer}"]
        assert record[f"{case}/{trainer}"] <= RTOL, (route, case, trainer, record[f"{case}/{trainer}"])
    layout = record[f"{case}/ours/layout"]
    assert layout["meshes"] == [mesh] and layout["buffers"] == buffers, layout
    assert layout["buffer_dtype"] == "torch.float32"
    assert layout["buffer_numel"] == layout["local_numel"] < layout["full_numel"], layout
    if route == "tp":
        assert layout["window_collectives"] == 0, layout  # both ranks see the same batch: nothing to sum


def test_adapter_attached_after_load_time_fsdp2_is_refused(four_ranks):
    """`get_peft_model` on a model `DistributedConfig(dp_replicate_size=2, fsdp_size=2)` sharded at load time: PEFT
    sizes `lora_B` from the local shard (8 rows of 16), so the stock Trainer's forward fails; ours refuses at
    construction, saying to attach the adapter before sharding (Accelerate's FSDP2 plugin, measured exact above)."""
    record = four_ranks["hsdp"]
    assert "must match the size of tensor b (8)" in record["lora/stock"], record["lora/stock"]
    refused = record["lora/ours"]
    prefix = "ValueError: GradAccumTrainer does not support trainable parameters added after"
    assert refused.startswith(prefix), refused
    assert "lora_A.default.weight" in refused and "Attach the adapter before sharding" in refused, refused


@pytest.mark.parametrize("name", ["cp", "sp"])
def test_context_and_sequence_parallelism_are_refused(name):
    """Accelerate's real `ParallelismConfig` with `cp_size` / `sp_size` 2 (the check reads only the Accelerator's
    config, so no processes are needed)."""
    from accelerate import ParallelismConfig

    from hf_gradaccum.distributed.parallelism import check_trainer_parallelism

    config = ParallelismConfig(**{f"{name}_size": 2})
    trainer = SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=config), model=None)
    with pytest.raises(ValueError, match=f"ParallelismConfig\\({name}_size=2\\)"):
        check_trainer_parallelism(trainer)
