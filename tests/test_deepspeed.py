"""`GradAccumTrainer` under real DeepSpeed ZeRO 1, 2 and 3 engines on 2 gloo CPU processes (`DS_ACCELERATOR=cpu`),
launched both ways users launch DeepSpeed: `TrainingArguments(deepspeed="configs/deepspeed/zeroN.json")` and an
Accelerate config with `distributed_type: DEEPSPEED`. Each launch runs many configurations in sequence
(tests/workers/deepspeed_cases.py); the tests read its records.

Parity: GA 4 x micro-batch 2 x 2 ranks on 16 samples, one SGD(lr=1) step, against one step on the 16 samples as one
batch (fp64). The stock Trainer's error is recorded next to ours: it must show the known failure on BERT (the head takes
`**kwargs`, so the Trainer neither divides by the accumulation steps nor stops multiplying by the ranks), so that the
comparison is known to detect a wrong update.

Run with `pytest -m deepspeed tests/test_deepspeed.py` (`-s` prints every record; excluded from `make test`; CI runs it
in `.ci/engines`).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.multiprocess import launch

# Skipped without DeepSpeed; found without importing it (the workers import it), so that collecting this module in
# `make test`, which deselects it, costs nothing.
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

pytestmark = pytest.mark.deepspeed

DS_ENV = {"DS_ACCELERATOR": "cpu"}
TOL = 1e-5


def _run(tmp_path_factory, mode: str, config: str) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp(f"deepspeed_{mode}")
    out = workdir / "records.json"
    launch(
        str(out),
        mode,
        str(workdir),
        script="tests/workers/deepspeed_cases.py",
        config=config,
        env=DS_ENV,
        timeout=900,
    )
    records = json.loads(out.read_text())
    # `pytest -s` shows every figure docs/engines.md quotes.
    for record in records:
        figures = {k: record[k] for k in ("trainer", "stage", "offload", "precision", "error") if k in record}
        print(f"{mode}: {record['case']}: {figures}")
    return {record["case"]: record for record in records}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    return _run(tmp_path_factory, "parity", "configs/accelerate/cpu_2proc.yaml")


@pytest.fixture(scope="module")
def accelerate_records(tmp_path_factory) -> dict[str, dict]:
    return _run(tmp_path_factory, "accelerate", "configs/accelerate/deepspeed_zero2_offload_cpu_2proc.yaml")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_parity_per_stage(records, stage, model):
    ours = records[f"zero{stage}_{model}_GradAccumTrainer"]
    stock = records[f"zero{stage}_{model}_Trainer"]
    assert ours["stage"] == stage and ours["engine"] == "DeepSpeedEngine" and ours["optimizer_steps"] == 1, ours
    assert ours["error"] <= TOL, ours
    if model == "bert":
        # The stock update is GA x ranks = 8 times the large batch's (relative error 7).
        assert stock["error"] == pytest.approx(7.0, rel=1e-4), stock
    else:
        assert stock["error"] <= TOL, stock  # a causal LM with `loss_type` set is exact under the stock Trainer too


@pytest.mark.parametrize("stage", [2, 3])
def test_parity_with_a_partial_last_window(records, stage):
    """24 samples: a window of 16, then one of 8 (2 micro-batches per rank) at the end of the epoch."""
    ours = records[f"zero{stage}_partial_gpt2_GradAccumTrainer"]
    assert ours["optimizer_steps"] == 2, ours
    assert ours["error"] <= TOL, ours


@pytest.mark.parametrize("stage", [2, 3])
def test_parity_with_clipping(records, stage):
    """`max_grad_norm=0.5` below the large batch's gradient norm (0.77): DeepSpeed clips the window's summed gradient,
    as the large batch's is clipped."""
    ours = records[f"zero{stage}_clip_gpt2_GradAccumTrainer"]
    assert ours["clipped_norm"] == 0.5, ours
    assert ours["error"] <= TOL, ours


@pytest.mark.parametrize("stage", [1, 3])
def test_parity_when_deepspeed_divides_by_its_accumulation_steps(records, stage):
    """Without the Trainer's `scale_wrt_gas=False`, DeepSpeed divides each loss by its accumulation steps; the weight
    undoes that."""
    ours = records[f"zero{stage}_scale_wrt_gas_bert_GradAccumTrainer"]
    assert ours["error"] <= TOL, ours


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_parity_zero3_with_optimizer_and_parameter_offload(records, model):
    record = records[f"zero3_offload_{model}_GradAccumTrainer"]
    assert record["offload"] and record["stage"] == 3, record
    assert record["error"] <= TOL, record


def test_sft_trainer_with_lora_under_zero2(records):
    assert records["sft_lora_zero2"]["error"] <= TOL, records["sft_lora_zero2"]


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_deepspeed_checkpoint_equals_uninterrupted_run(records, stage):
    record = records[f"resume_zero{stage}"]
    assert record["update_norm"] > 0.1, record  # the two windows moved the weights
    assert record["error"] <= TOL, record


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_accumulates_in_fp32(records, stage):
    record = records[f"zero{stage}_bf16_gpt2_GradAccumTrainer"]
    assert record["precision"] == "bf16" and record["grad_accum_dtype"] == "fp32", record
    # bf16 weights and forward: only the rounding of bf16 separates it from the fp64 large batch (a wrong weighting
    # is off by whole factors, as the stock BERT row shows).
    assert record["error"] < 0.05, record
    assert records["bf16_dtypes"]["data_types"] == {"grad_accum_dtype": "fp32"}
    assert records["bf16_dtypes"]["comm"] == "fp32"


@pytest.mark.parametrize(
    "option",
    [
        "auto_find_batch_size",
        "verify_accumulation",
        "offload_accumulation_buffer",
        "moe_load_balance",
        "take_back_skipped_steps",
        "fp16_recompute",
        "coupled_loss",
        "autotp",
    ],
)
def test_what_cannot_run_under_deepspeed_is_refused_at_construction(records, option):
    record = records[f"refuse_{option}"]
    assert record["refused"], record
    message = record["message"]
    assert "DeepSpeed" in message, message
    assert "Fix:" in message or "Set `overflow_policy='skip'`" in message, message


def test_partitions_are_the_engines_own(records):
    """GradAccumTrainer adds no tensor under DeepSpeed: each rank holds what the stock Trainer's engine holds, at the
    same accumulation steps and without accumulation (GA 1, the window as one micro-batch)."""
    for stage in (1, 2, 3):
        for model in ("bert", "gpt2"):
            ours = records[f"zero{stage}_{model}_GradAccumTrainer"]["partition_numel"]
            stock = records[f"zero{stage}_{model}_Trainer"]["partition_numel"]
            assert ours == stock, (stage, model, ours, stock)
            assert ours["fp32_master"] * 2 >= ours["total"] > ours["fp32_master"], ours  # ZeRO: half per rank
        one_pass = records[f"zero{stage}_bert_Trainer_ga1"]
        assert one_pass["optimizer_steps"] == 1, one_pass
        assert one_pass["partition_numel"] == records[f"zero{stage}_bert_GradAccumTrainer"]["partition_numel"]


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_accelerate_deepspeed_config(accelerate_records, model):
    ours = accelerate_records[f"accelerate_{model}_GradAccumTrainer"]
    stock = accelerate_records[f"accelerate_{model}_Trainer"]
    assert ours["stage"] == 2 and ours["offload"], ours
    assert ours["error"] <= TOL, ours
    if model == "bert":
        assert stock["error"] == pytest.approx(7.0, rel=1e-4), stock
