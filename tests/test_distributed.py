"""2 CPU processes (gloo, `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`): one optimizer step equals the large-batch step over all ranks'
samples (relative update error <= 1e-5), with uneven micro-batches and ranks that hold different item counts; one
flat-buffer reduction per window instead of one DDP all-reduce per bucket per micro-batch."""

import json

import pytest

from tests.multiprocess import launch
from tests.ordering import HAS_SAMPLING_STRATEGY
from tests.torch_features import needs_fsdp2_torch, needs_once_per_window_internals
from tests.workers import ddp_workers

# The Trainer workers fix the sample order with `train_sampling_strategy`, a transformers 5.x argument.
needs_sampling_strategy = pytest.mark.skipif(
    not HAS_SAMPLING_STRATEGY, reason="the DDP Trainer workers need TrainingArguments(train_sampling_strategy=...)"
)


# GPT-2 (shifted labels, token counts per rank) in the slow run only: the default run stays under 10 minutes.
@pytest.mark.parametrize("case_name", ["bert_seq_cls", pytest.param("gpt2_causal_lm", marks=pytest.mark.slow)])
def test_plain_loop_under_ddp_matches_large_batch(case_name, tmp_path):
    launch("plain_loop_parity", case_name, str(tmp_path))
    records = [json.loads((tmp_path / f"{case_name}_rank{r}.json").read_text()) for r in (0, 1)]
    for r in records:
        print(
            f"{case_name} rank {r['rank']}: rel. update error {r['err']:.2e}, local items {r['local_items']} of "
            f"{r['window_items']:.0f}; DDP all-reduces ours {r['ddp_allreduces_ours']} + flat-buffer reductions "
            f"{r['flat_buffer_reductions_ours']} vs stock {r['ddp_allreduces_stock']}"
        )
        assert r["err"] <= ddp_workers.RTOL
        assert r["ddp_allreduces_ours"] == 0 and r["flat_buffer_reductions_ours"] == 1
        assert r["ddp_allreduces_stock"] >= 2  # one per bucket per micro-batch without the no-sync path
    assert records[0]["local_items"] != records[1]["local_items"]
    assert (
        records[0]["window_items"]
        == records[1]["window_items"]
        == records[0]["local_items"] + records[1]["local_items"]
    )


# `user_compute_loss_func`: a loss that divides by the `num_items_in_batch` it is given, which the Trainer then
# multiplies by the number of ranks (`average_tokens_across_devices`).
@needs_sampling_strategy
@pytest.mark.parametrize(
    "case_name", ["bert_seq_cls", "user_compute_loss_func", pytest.param("gpt2_causal_lm", marks=pytest.mark.slow)]
)
def test_trainer_under_ddp_matches_large_batch(case_name, tmp_path):
    launch("trainer_parity", case_name, str(tmp_path))
    for r in (0, 1):
        record = json.loads((tmp_path / f"trainer_{case_name}_rank{r}.json").read_text())
        print(f"GradAccumTrainer DDP {case_name} rank {r}: rel. update error {record['err']:.2e}")
        assert record["err"] <= ddp_workers.RTOL


@needs_sampling_strategy
def test_trainer_fsdp1_is_refused_and_plain_fsdp2_accepted(tmp_path):
    launch("sharded_engines_refused", str(tmp_path))
    for r in (0, 1):
        messages = json.loads((tmp_path / f"refused_rank{r}.json").read_text())
        assert "FSDP2 only" in messages["fsdp1"] and "fsdp_version: 2" in messages["fsdp1"]
        assert messages["cpu_fsdp_enabled"] is False  # Accelerate shards only on GPU-type devices: DDP, warned
        assert "plain" not in messages and messages["plain_sharded"] is True
        assert "did not shard" in messages["partly_sharded"] and "classifier.weight" in messages["partly_sharded"]
        assert "`reduce_gradients=False` cannot be used with an FSDP2 model" in messages["no_reduce_sharded"]
        assert "`auto_find_batch_size=True` is not supported under FSDP2" in messages["fsdp2_auto_find_batch_size"]
        zero = messages["zero_item_masked_mean"]
        assert zero["applied"] is False and zero["skipped"] == {"non_finite_grad": 1} and zero["weights_unchanged"]
    # The rank that ran the item-less micro-batch says why its window was skipped and what to change.
    assert json.loads((tmp_path / "refused_rank1.json").read_text())["zero_item_masked_mean"]["hint_logged"]


@needs_fsdp2_torch
@needs_once_per_window_internals
def test_trainer_under_accelerate_fsdp2_matches_large_batch_and_resumes_bitwise(tmp_path):
    """GradAccumTrainer with Accelerate's FSDP2 plugin (fully_shard by Accelerate, gloo): the update equals the large
    batch with and without clipping on the global norm, and a resume from the sharded step-1 checkpoint ends bitwise
    equal to the uninterrupted run."""
    launch("trainer_fsdp2", "bert_token_cls", str(tmp_path))
    records = [json.loads((tmp_path / f"fsdp2_trainer_rank{r}.json").read_text()) for r in (0, 1)]
    print("GradAccumTrainer FSDP2:", records[0])
    for record in records:
        assert record["err_plain"] <= ddp_workers.RTOL, record
        assert record["err_clipped"] <= ddp_workers.RTOL, record
        assert record["err_once_per_window"] <= ddp_workers.RTOL, record
        assert all(norm > 0.05 for norm in record["grad_norms"]), record  # clipping was active
        assert record["resume_bitwise"] is True
    assert records[0]["grad_norms"] == records[1]["grad_norms"]  # the global norm, not each rank's shard


@pytest.mark.slow  # 70 s: two arms, each a 2-process job
def test_bert_recipe_under_two_process_launch_writes_report(tmp_path):
    """`accelerate launch` of the BERT recipe on 2 CPU processes (tiny config): each arm runs as a 2-rank job, the
    effective batch counts both ranks, and the accumulated arm still matches the large batch step for step."""
    from harness.reporting import load_parity_report

    out = tmp_path / "bert_2proc"
    proc = launch(
        "--config", "configs/finetune_bert_tiny.yaml", "--output_dir", str(out),
        script="recipes/finetune_bert.py", timeout=600,
    )  # fmt: skip
    report = load_parity_report(out / "parity_report.json")
    arms = {arm["name"]: arm for arm in report["arms"]}
    assert all(arm["status"] == "ok" for arm in arms.values()), proc.stdout[-3000:]
    assert {arm["world_size"] for arm in arms.values()} == {2}
    assert arms["reference"]["effective_batch_size"] == arms["accumulated"]["effective_batch_size"] == 32
    assert arms["accumulated"]["matches_reference"] is True, arms["accumulated"]["verdict"]
    assert (out / "loss_curves.png").stat().st_size > 0 and (out / "parity_report.md").is_file()


def test_in_place_path_under_ddp_with_parameters_touched_on_one_rank(tmp_path):
    launch("in_place_rank_specific_parameters", str(tmp_path))
    for r in (0, 1):
        record = json.loads((tmp_path / f"in_place_rank{r}.json").read_text())
        print(f"rank {r}: {record}")
        for path in ("in_place", "hooks"):
            assert record[path]["err"] <= ddp_workers.RTOL
            assert record[path]["unused_unchanged"] and record[path]["window_items"] == 10
            assert record[path]["reductions"] == 1
        assert record["in_place"]["in_place"] and not record["hooks"]["in_place"]
