"""Parity report: comparisons, verdicts, schema check, files; arm planning; the offline accuracy metric."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import evaluate
import pytest
import torch
from harness.arms import (
    ParityArguments,
    arm_overrides,
    failed_arm_result,
    parse_arm_name,
    plan_arms,
    save_arm_weights,
    train_losses_from_log_history,
)
from harness.metrics import metric_path
from harness.reporting import (
    build_parity_report,
    format_summary,
    group_means,
    loss_difference,
    relative_weight_distance,
    render_parity_markdown,
    validate_parity_report,
    write_parity_report,
)

ROOT = Path(__file__).resolve().parents[1]

META = dict(
    recipe="unit",
    command="python unit.py",
    model="tiny",
    dataset="synthetic",
    train_samples=128,
    eval_samples=32,
    num_train_epochs=1,
    seed=0,
    device="cpu (2 threads)",
    total_wall_time_s=12.0,
    majority_class_accuracy=0.5,
)


def make_arm(name, micro, steps, losses, *, compared_to=None, peak=1000.0, accuracy=0.8, **extra):
    kind = name.split("_")[0] if not name.startswith("small_batch") else "small_batch"
    arm = dict(
        name=name,
        kind=kind,
        status="ok",
        error=None,
        batchnorm="keep",
        batchnorm_layers=0,
        compared_to=compared_to,
        micro_batch_size=micro,
        gradient_accumulation_steps=steps,
        world_size=1,
        effective_batch_size=micro * steps,
        optimizer_steps=len(losses),
        epochs=1.0,
        train_loss=list(losses),
        eval_metrics={"eval_loss": 0.5, "eval_accuracy": accuracy},
        peak_memory_mb=peak,
        baseline_memory_mb=400.0,
        memory_kind="cpu_peak_rss",
        train_samples_per_second=100.0,
        train_runtime_s=1.0,
        wall_time_s=5.0,
    )
    arm.update(extra)
    return arm


@pytest.fixture
def arms():
    return [
        make_arm("reference", 16, 1, [0.7, 0.6, 0.5, 0.4], peak=2000.0),
        make_arm("accumulated", 4, 4, [0.7, 0.6 + 2e-7, 0.5, 0.4 - 1e-7], compared_to="reference", peak=900.0),
        make_arm("small_batch", 4, 1, [0.8, 0.6, 0.7, 0.5] * 4, compared_to="reference", peak=890.0, accuracy=0.75),
    ]


def test_loss_difference_per_step_and_equal_samples():
    assert loss_difference([1.0, 2.0], [1.0, 2.5], samples_per_step=8, reference_samples_per_step=8) == (
        0.5,
        "per_step",
    )
    diff, basis = loss_difference([1.0, 3.0, 2.0, 2.0], [2.0, 1.0], samples_per_step=4, reference_samples_per_step=8)
    assert (diff, basis) == (1.0, "equal_samples")
    # 8 samples per step cannot be lined up with 12.
    assert loss_difference([1.0], [1.0], samples_per_step=8, reference_samples_per_step=12) == (None, None)
    assert group_means([1, 2, 3, 4, 5], 2) == [1.5, 3.5]


def test_relative_weight_distance():
    a = {"w": torch.ones(4), "b": torch.zeros(2)}
    assert relative_weight_distance(a, a) == 0.0
    b = {"w": torch.ones(4) * 1.5, "b": torch.zeros(2)}
    assert relative_weight_distance(b, a) == pytest.approx(0.5)
    assert relative_weight_distance({"x": torch.ones(1)}, a) is None  # nothing shared


def test_build_report_compares_and_gives_verdicts(arms, tmp_path):
    weights = {}
    # 1 + 2**-16 is exact in float32, so the expected distance is too.
    for arm, scale in zip(arms, (1.0, 1.0 + 2**-16, 1.1), strict=True):
        model = torch.nn.Linear(3, 2)
        torch.nn.init.constant_(model.weight, scale)
        torch.nn.init.constant_(model.bias, 0.0)
        weights[arm["name"]] = save_arm_weights(model, tmp_path / arm["name"] / "w.safetensors")
    report = build_parity_report(arms, metadata=META, max_memory_mb=1024, weight_paths=weights)
    by_name = {a["name"]: a for a in report["arms"]}

    accumulated = by_name["accumulated"]
    assert accumulated["matches_reference"] is True and accumulated["loss_diff_basis"] == "per_step"
    assert accumulated["max_abs_loss_diff"] == pytest.approx(2e-7, rel=1e-3)
    assert accumulated["weight_distance"] == pytest.approx(2**-16, rel=1e-6)
    assert accumulated["verdict"].startswith("accumulated: matches the large batch (max |Δloss| 2e-07, weights 2e-05")
    assert "45% of the large batch's" in accumulated["verdict"] and "fits in 1,024 MiB" in accumulated["verdict"]

    reference = by_name["reference"]
    assert reference["fits_memory_limit"] is False and "would NOT fit in 1,024 MiB" in reference["verdict"]
    assert reference["matches_reference"] is None and reference["max_abs_loss_diff"] is None

    small = by_name["small_batch"]
    assert small["loss_diff_basis"] == "equal_samples" and small["matches_reference"] is False
    assert small["weight_distance"] == pytest.approx(0.1, rel=1e-5)
    assert "4x as many steps of 4 samples" in small["verdict"] and "accuracy 0.750 vs 0.800" in small["verdict"]


def test_mismatch_verdict_explains_batchnorm(arms):
    arms[1].update(train_loss=[0.7, 0.65, 0.5, 0.4], batchnorm_layers=5)
    report = build_parity_report(arms, metadata=META)
    verdict = report["arms"][1]["verdict"]
    assert "does NOT match the large batch (max |Δloss| 5.0e-02 > 1e-04" in verdict
    assert "5 BatchNorm layers normalise over micro-batches of 4, not over the batch of 16" in verdict
    assert report["arms"][1]["fits_memory_limit"] is None  # no limit given


def test_noise_floor_separates_rounding_drift_from_a_different_forward_pass(arms):
    """A drifting arm counts as within the noise floor only if step 1 agrees (same forward pass) and its drift is no
    larger than the reference's own drift under a 1e-7 weight perturbation; `matches_reference` stays strict."""
    arms[1].update(train_loss=[0.7, 0.6 + 2e-7, 0.52, 0.41])  # drifts after step 1 by up to 2e-2
    floor = make_arm("noise_floor", 16, 1, [0.7 + 1e-7, 0.6, 0.47, 0.43], compared_to="reference", kind="noise_floor")
    assert floor["kind"] == "noise_floor"
    report = build_parity_report([*arms, floor], metadata=META)
    accumulated, floor_entry = report["arms"][1], report["arms"][3]
    assert accumulated["matches_reference"] is False
    assert accumulated["first_step_loss_diff"] == 0.0
    assert accumulated["noise_floor_loss_diff"] == pytest.approx(0.03)
    assert accumulated["within_noise_floor"] is True
    assert "the large-batch computation up to fp32 rounding" in accumulated["verdict"]
    assert "how far rounding alone moves this training run" in floor_entry["verdict"]
    assert floor_entry["within_noise_floor"] is None  # the yardstick is not measured against itself
    assert "step-1" in render_parity_markdown(report)

    # Step 1 already differs (BatchNorm over micro-batches): not rounding, whatever the later drift.
    arms[1].update(train_loss=[0.71, 0.6, 0.5, 0.4], batchnorm_layers=3)
    accumulated = build_parity_report([*arms, floor], metadata=META)["arms"][1]
    assert accumulated["within_noise_floor"] is False
    assert "does NOT match" in accumulated["verdict"] and "BatchNorm layers" in accumulated["verdict"]
    arms[1].update(batchnorm_layers=0)  # the same step-1 gap without BatchNorm to blame
    accumulated = build_parity_report([*arms, floor], metadata=META)["arms"][1]
    assert "step 1 already differs (1.0e-02)" in accumulated["verdict"]

    # Drifting an order of magnitude further than the noise floor: not explained by rounding either.
    arms[1].update(train_loss=[0.7, 0.6, 0.9, 0.4], batchnorm_layers=0)
    accumulated = build_parity_report([*arms, floor], metadata=META)["arms"][1]
    assert accumulated["max_abs_loss_diff"] == pytest.approx(0.4)
    assert accumulated["max_abs_loss_diff"] > 10 * accumulated["noise_floor_loss_diff"]
    assert accumulated["within_noise_floor"] is False
    assert "more than 10x the large batch's own drift" in accumulated["verdict"]


def test_noise_floor_arm_planning_and_perturbation():
    from harness.arms import perturb_for_noise_floor

    specs = plan_arms(
        ["reference_groupnorm", "accumulated_groupnorm", "noise_floor_groupnorm"],
        micro_batch_size=4,
        gradient_accumulation_steps=4,
    )
    floor = specs[2]
    assert (floor.kind, floor.batchnorm, floor.micro_batch_size, floor.gradient_accumulation_steps) == (
        "noise_floor", "groupnorm", 16, 1,
    )  # fmt: skip
    assert floor.compared_to == "reference_groupnorm"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    after = torch.cat([p.detach().flatten() for p in perturb_for_noise_floor(model).parameters()])
    relative = float((after - before).norm() / before.norm())
    assert 5e-8 < relative < 2e-7


def test_failed_and_oom_arms(arms):
    spec = plan_arms(["reference", "accumulated"], micro_batch_size=4, gradient_accumulation_steps=4)[0]
    arms[0] = failed_arm_result(spec, "CUDA out of memory", status="oom")
    report = build_parity_report(arms, metadata=META, max_memory_mb=1024)
    reference, accumulated = report["arms"][0], report["arms"][1]
    assert reference["fits_memory_limit"] is False
    assert reference["verdict"] == "reference: did not finish: out of memory under the 1,024 MiB limit."
    assert accumulated["max_abs_loss_diff"] is None  # nothing to compare with
    assert "not compared" in accumulated["verdict"]


def test_schema_rejects_bad_reports(arms):
    report = build_parity_report(arms, metadata=META)
    validate_parity_report(report)
    json.loads(json.dumps(report))  # JSON-ready

    for mutate, message in [
        (lambda r: r.pop("arms"), "missing key 'arms'"),
        (lambda r: r.update(train_samples="128"), "train_samples is str"),
        (lambda r: r["arms"][0].update(status="done"), "status 'done'"),
        (lambda r: r["arms"][1].update(compared_to="nope"), "compared_to 'nope'"),
        (lambda r: r["arms"][1].update(train_loss=[0.1]), "train_loss has 1 values for 4 optimizer steps"),
        (lambda r: r["arms"][1].update(optimizer_steps=True), "optimizer_steps is a bool"),
        (lambda r: r["arms"].append(copy.deepcopy(r["arms"][0])), "duplicate arm names"),
        (lambda r: r["arms"][2].pop("verdict"), "missing key arms[2].'verdict'"),
    ]:
        bad = copy.deepcopy(report)
        mutate(bad)
        with pytest.raises(ValueError, match=__import__("re").escape(message)):
            validate_parity_report(bad)


def test_write_report_files(arms, tmp_path):
    report = build_parity_report(arms, metadata=META, max_memory_mb=1024)
    paths = write_parity_report(report, tmp_path)
    assert sorted(paths) == ["json", "loss_curves", "markdown", "memory"]
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(report))
    for kind in ("loss_curves", "memory"):
        assert paths[kind].read_bytes()[:4] == b"\x89PNG" and paths[kind].stat().st_size > 1000
    markdown = render_parity_markdown(report)
    assert markdown.startswith("# Parity report: unit")
    assert "| accumulated | 4 x 4 = 16 | keep | 4 | accuracy 0.800 | 2.0e-07 vs reference |" in markdown
    summary = format_summary(report)
    assert len(summary.splitlines()) < 25 and "accumulated: matches the large batch" in summary


# ---------------------------------------------------------------------------------------------------- arms
def test_arm_names_and_plan():
    assert parse_arm_name("accumulated_freeze") == ("accumulated", "freeze")
    with pytest.raises(ValueError, match="Unknown arm 'accumulated_layernorm'"):
        parse_arm_name("accumulated_layernorm")
    names = ["reference", "accumulated", "small_batch", "reference_groupnorm", "accumulated_groupnorm"]
    names += ["accumulated_freeze", "accumulated_momentum"]
    specs = {s.name: s for s in plan_arms(names, micro_batch_size=8, gradient_accumulation_steps=4)}
    assert (specs["reference"].micro_batch_size, specs["reference"].gradient_accumulation_steps) == (32, 1)
    assert (specs["small_batch"].micro_batch_size, specs["small_batch"].gradient_accumulation_steps) == (8, 1)
    assert specs["accumulated_groupnorm"].compared_to == "reference_groupnorm"
    assert specs["accumulated_momentum"].compared_to == "reference"  # momentum changes running stats only
    assert specs["accumulated_freeze"].compared_to is None  # no frozen reference was run
    assert specs["reference_groupnorm"].compared_to is None


def test_parity_arguments_validation():
    with pytest.raises(ValueError, match="lists an arm twice"):
        ParityArguments(arms=["reference", "reference"])
    with pytest.raises(ValueError, match="max_memory_mb"):
        ParityArguments(max_memory_mb=0)
    with pytest.raises(ValueError, match="not one of `arms`"):
        ParityArguments(arms=["reference"], run_single_arm="accumulated")


def test_arm_overrides_force_per_step_logging():
    spec = plan_arms(["accumulated"], micro_batch_size=8, gradient_accumulation_steps=4)[0]
    tokens = arm_overrides(spec, "out")
    pairs = dict(zip(tokens[::2], tokens[1::2], strict=True))
    assert pairs["--per_device_train_batch_size"] == "8" and pairs["--gradient_accumulation_steps"] == "4"
    assert pairs["--logging_steps"] == "1" and pairs["--save_strategy"] == "no"
    assert pairs["--output_dir"].endswith("arms/accumulated")


def test_train_losses_from_log_history():
    history = [{"loss": 0.5, "step": 1}, {"loss": 0.4, "step": 2}, {"train_loss": 0.45, "step": 2}]
    assert train_losses_from_log_history(history) == [0.5, 0.4]


# ---------------------------------------------------------------------------------------------------- metric
def test_offline_accuracy_metric():
    metric = evaluate.load(metric_path("accuracy"))
    result = metric.compute(predictions=[1, 1, 0, 0], references=[1, 0, 0, 0])
    assert result["accuracy"] == 0.75
    # class 0: P=1, R=2/3 -> F1=0.8; class 1: P=0.5, R=1 -> F1=2/3
    assert result["macro_f1"] == pytest.approx((0.8 + 2 / 3) / 2)
    assert metric.compute(predictions=[1, 0], references=[1, 1], normalize=False)["accuracy"] == 1
    with pytest.raises(ValueError, match="hf_gradaccum ships"):
        metric_path("bleu")


@pytest.mark.parametrize("recipe", ["bert", "resnet"])
def test_every_line_of_the_loss_plot_is_in_its_legend(recipe):
    """Committed reports: every drawn line has a legend entry; the ResNet figure has one row per BatchNorm
    treatment (small multiples)."""
    import matplotlib.pyplot as plt
    from harness.reporting import load_parity_report, loss_curves_figure

    report = load_parity_report(ROOT / "docs" / recipe / "parity_report.json")
    fig = loss_curves_figure(report)
    try:
        treatments = {a.get("batchnorm") or "keep" for a in report["arms"] if a["status"] == "ok"}
        assert len(fig.axes) == 2 * len(treatments)
        for ax in fig.axes:
            legend = ax.get_legend()
            assert legend is not None
            entries = {t.get_text() for t in legend.get_texts()}
            for line in ax.get_lines():
                assert line.get_label() in entries, (ax.get_title(), line.get_label())
    finally:
        plt.close(fig)


def test_no_report_when_every_arm_failed(tmp_path, capsys):
    from harness.arms import report_parity_run

    specs = plan_arms(["reference", "accumulated"], micro_batch_size=2, gradient_accumulation_steps=2)
    results = [failed_arm_result(spec, "ValueError: boom") for spec in specs]
    status = report_parity_run(
        results, specs, metadata=META, parity_args=ParityArguments(), output_dir=tmp_path, saved_arm="accumulated"
    )
    assert status == 1
    assert "Every arm failed; no report written" in capsys.readouterr().err
    assert not list(tmp_path.glob("parity_report.*"))


def test_failed_arm_prints_one_line_with_cause_and_log(tmp_path, capsys):
    """A real child process that raises: one line on the console names the exception and the log's path."""

    from harness.arms import run_arms_in_subprocesses

    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('working...')\nraise ValueError('learning rate went negative')\n")
    (spec,) = plan_arms(["reference"], micro_batch_size=2, gradient_accumulation_steps=2)
    (result,) = run_arms_in_subprocesses([spec], script=script, argv=[], output_dir=tmp_path)
    out = capsys.readouterr().out
    log = tmp_path / "arms" / "reference" / "arm.log"
    line = f"=== arm reference failed: ValueError: learning rate went negative (full log: {log}) ==="
    assert line in out
    assert result["status"] == "failed" and result["log"] == str(log)
    assert "Traceback" in log.read_text() and "working..." in log.read_text()


def test_recipes_add_the_check_except_under_an_fsdp_launch(monkeypatch):
    """`accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP; the check (refused under FSDP2) is then turned
    off explicitly (the recipes' own default is `first_step`, shown by `--help`), so the documented
    `configs/accelerate/fsdp2.yaml` launch of a recipe does not stop on it."""
    from harness.verification_report import with_verification

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert with_verification(["--x"], None) == ["--x", "--verify_accumulation", "first_step"]
    assert with_verification(["--verify_accumulation", "off"], None) == ["--verify_accumulation", "off"]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert with_verification(["--x"], None) == ["--x", "--verify_accumulation", "off"]
