"""`effective_batch_size` on real gloo processes: a batch of 10 that does not divide (4+3+3 on 3 processes, 3+3+2+2 on
4) ends at the stock Trainer's one-process weights for that batch (AdamW, linear schedule with warmup, clipping; 38
rows, so the last window of 8 is split too), in sequential and random order, and a checkpoint resumes on another
number of processes or micro-batch with the same bound. The stock Trainer's own error at the layouts it can express
is measured beside ours. Workers: tests/workers/run_batch_cases.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.multiprocess import launch, run_script
from tests.ordering import HAS_SAMPLING_STRATEGY
from tests.torch_features import needs_fsdp2_torch
from tests.workers.run_batch_cases import full_state, initial_model_and_data, our_run, relative_error, stock_run

pytestmark = pytest.mark.skipif(not HAS_SAMPLING_STRATEGY, reason="needs TrainingArguments(train_sampling_strategy=)")

SCRIPT = "tests/workers/run_batch_cases.py"
RTOL = 1e-5


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """The stock Trainer's one-process run of the batch of 10, per order."""
    out = tmp_path_factory.mktemp("run_batch_reference")
    return {order: full_state(stock_run(str(out / order), order)) for order in ("sequential", "random")}


def _errors(out, references, world_size: int, names: list[str]) -> dict[str, float]:
    initial, _ = initial_model_and_data()
    errors = {}
    for name in names:
        record = json.loads((out / f"{name}_w{world_size}.json").read_text())
        assert record["world_size"] == world_size and record["global_step"] == 4, record
        order = name.split("_")[1]
        errors[name] = relative_error(torch.load(out / f"{name}_w{world_size}.pt"), references[order], initial)
        print(f"{world_size} process(es), {name} ({record.get('layout', 'stock')}): rel. error {errors[name]:.2e}")
    return errors


def test_three_processes_uneven_split_and_resume_from_one_process(tmp_path, references):
    """10 = 4+3+3 (micro-batches [2,2], [2,1], [2,1]); a one-process checkpoint at step 2 (micro-batch 4, 3 per
    window) continued on 3 processes with micro-batch 2."""
    single = our_run(str(tmp_path / "w1"), "sequential", micro=4, save=True)
    initial, _ = initial_model_and_data()
    assert relative_error(full_state(single), references["sequential"], initial) <= RTOL
    checkpoint = tmp_path / "w1" / "checkpoint-2"
    launch(
        str(tmp_path), "ours:sequential:2", f"ours:sequential:2:resume={checkpoint}", script=SCRIPT, num_processes=3
    )
    record = json.loads((tmp_path / "ours_sequential_2_w3.json").read_text())
    assert record["layout"] == "10 = 4+3+3" and record["last_window"] == "8 = 3+3+2"
    assert record["gradient_accumulation_steps"] == 2 and record["steps_run"] == 4
    resumed = json.loads((tmp_path / "ours_sequential_2_resume_w3.json").read_text())
    assert resumed["steps_run"] == 2  # windows 3 and 4 only
    errors = _errors(tmp_path, references, 3, ["ours_sequential_2", "ours_sequential_2_resume"])
    assert all(error <= RTOL for error in errors.values()), errors


@pytest.mark.slow  # four launches of 1 to 4 processes
def test_every_layout_is_the_one_process_run_and_resumes_across_layouts(tmp_path, references):
    """1, 2, 3 and 4 processes, both orders; resume 2 -> 3 processes and 3 -> 1 with another micro-batch. The stock
    Trainer at the layouts it can express (2 x 5, and 5 x 2 accumulated on one process) is measured beside ours and
    must show the error this harness exists to catch."""
    stock = ["stock:sequential:5:1", "stock:random:5:1"]
    launch(str(tmp_path), "ours:sequential:2:save", "ours:random:2", *stock, script=SCRIPT, num_processes=2)
    w2 = tmp_path / "ours_sequential_2_save_w2" / "checkpoint-2"
    launch(
        str(tmp_path), "ours:sequential:2:save", "ours:random:2", f"ours:sequential:2:resume={w2}",
        script=SCRIPT, num_processes=3,
    )  # fmt: skip
    w3 = tmp_path / "ours_sequential_2_save_w3" / "checkpoint-2"
    launch(str(tmp_path), "ours:sequential:2", "ours:random:2", script=SCRIPT, num_processes=4)
    run_script(SCRIPT, str(tmp_path), "ours:random:3", f"ours:sequential:3:resume={w3}", "stock:sequential:5:2")
    ours = {
        1: ["ours_random_3", "ours_sequential_3_resume"],
        2: ["ours_sequential_2_save", "ours_random_2"],
        3: ["ours_sequential_2_save", "ours_random_2", "ours_sequential_2_resume"],
        4: ["ours_sequential_2", "ours_random_2"],
    }
    for world_size, names in ours.items():
        errors = _errors(tmp_path, references, world_size, names)
        assert all(error <= RTOL for error in errors.values()), (world_size, errors)
    for world_size, name in ((3, "ours_sequential_2_resume"), (1, "ours_sequential_3_resume")):
        assert json.loads((tmp_path / f"{name}_w{world_size}.json").read_text())["steps_run"] == 2
    layouts = {w: json.loads((tmp_path / f"{ours[w][0]}_w{w}.json").read_text())["layout"] for w in ours}
    assert layouts == {1: "10 = 10", 2: "10 = 5+5", 3: "10 = 4+3+3", 4: "10 = 3+3+2+2"}
    stock_errors = _errors(tmp_path, references, 2, ["stock_sequential_5_1", "stock_random_5_1"])
    stock_errors |= _errors(tmp_path, references, 1, ["stock_sequential_5_2"])
    assert all(error > 1e-3 for error in stock_errors.values()), stock_errors


def _engine_case(tmp_path, references, engine: str, env: dict[str, str] | None = None, timeout: int = 300) -> None:
    launch(str(tmp_path), f"ours:sequential:2:engine={engine}", script=SCRIPT, num_processes=3, env=env,
           timeout=timeout)  # fmt: skip
    record = json.loads((tmp_path / "ours_sequential_2_engine_w3.json").read_text())
    assert record["engine"] == ("fsdp" if engine == "fsdp2" else "deepspeed") and record["layout"] == "10 = 4+3+3"
    errors = _errors(tmp_path, references, 3, ["ours_sequential_2_engine"])
    assert all(error <= RTOL for error in errors.values()), errors


@needs_fsdp2_torch
@pytest.mark.slow
def test_fsdp2_three_processes_uneven_split(tmp_path, references):
    """Accelerate's FSDP2 plugin (`fully_shard` on gloo): one reduce-scatter per micro-batch, so every rank must run
    the same micro-batches; 4+3+3 rows."""
    _engine_case(tmp_path, references, "fsdp2")


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_zero2_three_processes_uneven_split(tmp_path, references):
    """DeepSpeed ZeRO-2 (`DS_ACCELERATOR=cpu`; the first launch compiles DeepSpeed's CPU ops): 4+3+3 rows."""
    _engine_case(tmp_path, references, "zero2", env={"DS_ACCELERATOR": "cpu"}, timeout=900)
