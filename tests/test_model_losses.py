"""Models whose forward fixes their own loss normalisation train exactly with default arguments, or stop before their
first optimizer step with the cause: the weighting is measured on the first window, never assumed.

Each case: one SGD step of `GradAccumTrainer` at 4 x 3 against the stock Trainer's one batch of the same 12 rows
(CPU fp32); exact means <= 1e-5 relative on the update."""

import copy
import json
import math

import pytest
import torch

from hf_gradaccum.engine.loss_normalisation import measure_loss_normalisation
from hf_gradaccum.losses.model_losses import ModelLossError
from hf_gradaccum.verification.windows import concat_window, take_rows

from .model_loss_cases import build, flat, one_step

TOLERANCE = 1e-5

EXACT = {
    # case -> the weighting the first window must find
    "bert_seq_cls": "label_tokens",
    "llama_causal_lm": "shifted_label_tokens",
    "wav2vec2_ctc_sum": "sum",
    "wav2vec2_ctc_mean": "rows",
    "bert_pretraining": "terms",
    "clip_return_loss": "coupled",
    "siglip_return_loss": "coupled",
    "mixtral_router_loss": None,  # the MoE window mode (a causal LM)
    "yolos_detection": "terms",  # class term over weighted queries, box terms over boxes
}
REFUSED = {"resnet_batchnorm": "BatchNorm"}


def _update_error(name: str, tmp_path) -> tuple[float, dict]:
    model, rows = build(name)
    start = flat(model)
    reference = copy.deepcopy(model)
    one_step(reference, rows, str(tmp_path / "stock"), ours=False, micro=12, steps=1)
    one_step(model, rows, str(tmp_path / "ours"), ours=True, micro=4, steps=3)
    delta, delta_ref = flat(model) - start, flat(reference) - start
    check = tmp_path / "ours" / "accumulation_check.json"
    record = json.loads(check.read_text()) if check.exists() else {}
    return float((delta - delta_ref).norm() / delta_ref.norm()), record


@pytest.mark.parametrize("name", sorted(EXACT))
def test_default_arguments_train_the_large_batch(name, tmp_path):
    error, record = _update_error(name, tmp_path)
    assert error <= TOLERANCE, f"{name}: update {error:.3g} from the large batch's"
    if EXACT[name] is not None:
        assert record["loss_normalisation"]["rule"] == EXACT[name], record


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_no_weighting_makes_exact_stops_before_the_first_step(name, tmp_path):
    model, rows = build(name)
    start = flat(model)
    with pytest.raises(ModelLossError, match=REFUSED[name]) as caught:
        one_step(model, rows, str(tmp_path / "ours"), ours=True, micro=4, steps=3)
    assert type(model).__name__ in str(caught.value) and "Fix" in str(caught.value)
    assert torch.equal(flat(model), start), "a refusal must leave the weights untouched"


def test_batchnorm_per_micro_batch_when_named(tmp_path):
    model, rows = build("resnet_batchnorm")
    start = flat(model)
    one_step(model, rows, str(tmp_path / "ours"), ours=True, micro=4, steps=3, batchnorm_statistics="micro_batch")
    assert not torch.equal(flat(model), start)


def test_a_named_weighting_is_not_measured(tmp_path):
    model, rows = build("wav2vec2_ctc_mean")
    one_step(model, rows, str(tmp_path / "ours"), ours=True, micro=4, steps=3, loss_normalisation="rows")
    record = json.loads((tmp_path / "ours" / "accumulation_check.json").read_text())
    assert record["loss_normalisation"]["decided_by"] == "declared"


@pytest.mark.parametrize("value", ["mean", "tokens", ""])
def test_bad_loss_normalisation_is_refused_by_name(value, tmp_path):
    from hf_gradaccum import GradAccumArguments

    with pytest.raises(ValueError, match="loss_normalisation"):
        GradAccumArguments(str(tmp_path), loss_normalisation=value)
    with pytest.raises(ValueError, match="batchnorm_statistics"):
        GradAccumArguments(str(tmp_path), batchnorm_statistics=value)


# ---------------------------------------------------------------------------------------------------- the measurement
def _window(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    window = []
    for rows in (3, 1, 1, 4):
        labels = torch.randint(0, 5, (rows, 6), generator=g)
        labels[torch.rand(rows, 6, generator=g) < 0.4] = -100
        window.append({"x": torch.randn(rows, 6, generator=g), "labels": labels})
    return window


def _token_losses(batch):
    mask = batch["labels"].ne(-100)
    return (batch["x"].exp() * mask).sum(), mask.sum(), len(batch["x"])


LOSSES = {
    "label_tokens": lambda b: float(_token_losses(b)[0] / _token_losses(b)[1]),
    "rows": lambda b: float(_token_losses(b)[0] / _token_losses(b)[2]),
    "sum": lambda b: float(_token_losses(b)[0]),
    # a statistic of the batch: each row against the batch's mean
    "none": lambda b: float(((b["x"] - b["x"].mean(0)) ** 2).sum() / len(b["x"])),
}


@pytest.mark.parametrize("truth", sorted(LOSSES))
def test_measurement_finds_the_normalisation_from_values(truth):
    finding = measure_loss_normalisation(
        LOSSES[truth], _window(), take_rows=take_rows, concat=concat_window, prior="label_tokens", max_cuts=3
    )
    assert finding.rule == truth, finding
    # Three cuts across the window; where nothing holds, one forward more (is the forward random?) and the cuts a
    # class-weighted count needs to be solved for (five classes: two equations to check, four cuts more).
    assert finding.cuts == (3 if truth != "none" else 7) and finding.forwards == 3 * finding.cuts + (truth == "none")
    if truth != "none":
        assert finding.residuals[truth] <= 1e-6
    assert all(math.isfinite(v) or v == math.inf for v in finding.residuals.values())


def test_measurement_keeps_the_prior_where_rules_weigh_alike():
    # One label per row: rows and label tokens weigh every row alike, so the data cannot tell them apart.
    window = [{"x": torch.randn(n, 3), "labels": torch.zeros(n, dtype=torch.long)} for n in (2, 3)]
    finding = measure_loss_normalisation(
        lambda b: float(b["x"].sum() / len(b["x"])), window, take_rows=take_rows, concat=concat_window, prior="rows"
    )
    assert finding.rule == "rows" and finding.decided_by == "tie" and "label_tokens" in finding.equivalent


# ---------------------------------------------------------------------------------------------------- the plain loop
def _plain_loop(model, rows, **options):
    """One SGD step of 3 micro-batches of 4 rows through `GradientAccumulator.backward(loss, batch=...)`."""
    from hf_gradaccum import GradientAccumulator

    from .model_loss_cases import collate

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulator = GradientAccumulator(model, gradient_accumulation_steps=3, **options)
    model.train()
    for start in range(0, 12, 4):
        batch = collate(rows[start : start + 4])
        accumulator.backward(model(**batch).loss, batch=batch)
    accumulator.step(optimizer)
    return accumulator


@pytest.mark.parametrize(
    ("name", "rule"), [("wav2vec2_ctc_sum", "sum"), ("wav2vec2_ctc_mean", "rows"), ("llama_causal_lm", None)]
)
def test_plain_loop_weights_by_the_measured_rule(name, rule, tmp_path):
    model, rows = build(name)
    start = flat(model)
    reference = copy.deepcopy(model)
    one_step(reference, rows, str(tmp_path / "stock"), ours=False, micro=12, steps=1)
    accumulator = _plain_loop(model, rows)
    delta, delta_ref = flat(model) - start, flat(reference) - start
    assert float((delta - delta_ref).norm() / delta_ref.norm()) <= TOLERANCE
    assert accumulator.normalisation.rule == (rule or "shifted_label_tokens")


@pytest.mark.parametrize(("name", "match"), [("resnet_batchnorm", "BatchNorm"), ("bert_pretraining", "own counts")])
def test_plain_loop_refuses_before_anything_is_accumulated(name, match):
    model, rows = build(name)
    start = flat(model)
    with pytest.raises(ModelLossError, match=match):
        _plain_loop(model, rows)
    assert torch.equal(flat(model), start) and all(p.grad is None for p in model.parameters())


def test_a_loss_that_couples_the_batch_stops_with_the_cause(tmp_path):
    """A subclass whose loss is an in-batch softmax over the rows' first logits: no count makes the parts add up."""
    from hf_gradaccum import GradAccumTrainer

    from .model_loss_cases import Rows, collate

    class InBatchTrainer(GradAccumTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            loss = -torch.log_softmax(logits[:, 0], dim=0).mean()  # each row against the other rows
            return (loss, {"logits": logits}) if return_outputs else loss

    model, rows = build("bert_seq_cls")
    start = flat(model)
    from hf_gradaccum import GradAccumArguments

    args = GradAccumArguments(
        str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=1, use_cpu=True,
        report_to=[], save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = InBatchTrainer(model=model, args=args, train_dataset=Rows(rows), data_collator=collate)
    with pytest.raises(ModelLossError, match="not a mean over any count"):
        trainer.train()
    assert torch.equal(flat(model), start) and trainer.state.global_step == 0


def test_plain_loop_reweighs_a_tie_on_later_batches(tmp_path):
    """The first batch carries 3 label tokens in every row (label tokens and rows tie there); later batches do not:
    the tie is re-weighed against the first batch, rows drops out, and the step stays exact."""
    from transformers import BertForTokenClassification

    from .model_loss_cases import _bert

    g = torch.Generator().manual_seed(4)
    rows = []
    for i in range(12):
        labels = torch.randint(0, 3, (8,), generator=g)
        labels[(3 if i < 4 else 1 + i % 5) :] = -100
        rows.append({"input_ids": torch.randint(1, 64, (8,), generator=g), "labels": labels,
                     "attention_mask": torch.ones(8, dtype=torch.long)})  # fmt: skip
    torch.manual_seed(0)
    model = BertForTokenClassification(_bert(num_labels=3))
    start = flat(model)
    reference = copy.deepcopy(model)
    one_step(reference, rows, str(tmp_path / "stock"), ours=False, micro=12, steps=1)
    accumulator = _plain_loop(model, rows)
    delta, delta_ref = flat(model) - start, flat(reference) - start
    assert float((delta - delta_ref).norm() / delta_ref.norm()) <= TOLERANCE
    assert accumulator.normalisation.decided_by == "tie" and "rows" in accumulator.normalisation.equivalent
    # The second batch decided it (rows and the attended tokens contradicted): nothing left to re-weigh on the third.
    assert accumulator._tie.windows_checked == 1 and accumulator._tie.cuts == 1 and accumulator._tie.tied == []


def test_padding_free_micro_batches_are_measured_and_exact(tmp_path):
    """One packed row per micro-batch with flash-attention kwargs (`DataCollatorWithFlattening`): the measurement joins
    whole micro-batches (their kwargs dropped, `position_ids` keep the sequences apart) and the step is the large
    batch's."""
    import json

    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer

    from hf_gradaccum import GradAccumArguments, GradAccumTrainer

    from .model_loss_cases import Rows

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": torch.randint(1, 64, (int(n),), generator=g).tolist()} for n in [3, 9, 4, 7] * 3]
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def step(ours: bool, micro: int, steps: int, out: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        start = flat(model)
        args = (GradAccumArguments if ours else __import__("transformers").TrainingArguments)(
            out, per_device_train_batch_size=micro, gradient_accumulation_steps=steps, max_steps=1, optim="sgd",
            learning_rate=0.1, max_grad_norm=0.0, lr_scheduler_type="constant", train_sampling_strategy="sequential",
            remove_unused_columns=False, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        (GradAccumTrainer if ours else Trainer)(
            model=model, args=args, train_dataset=Rows(rows), data_collator=collate
        ).train()
        return flat(model) - start

    reference = step(False, 12, 1, str(tmp_path / "stock"))
    ours = step(True, 3, 4, str(tmp_path / "ours"))
    assert float((ours - reference).norm() / reference.norm()) <= TOLERANCE
    finding = json.loads((tmp_path / "ours" / "accumulation_check.json").read_text())["loss_normalisation"]
    assert finding["cuts"] >= 2 and finding["decided_by"] in ("values", "tie"), finding


def test_a_loose_tolerance_keeps_the_rule_the_cuts_single_out():
    """Under a bf16-like tolerance every rule holds, but one fits the cuts orders of magnitude better: it is kept (the
    values decide), and the others are named; where no rule stands out, it is a stop."""
    window = _window()
    finding = measure_loss_normalisation(
        LOSSES["label_tokens"], window, take_rows=take_rows, concat=concat_window, prior="rows", tolerance=0.9
    )
    assert finding.rule == "label_tokens" and finding.decided_by == "values" and not finding.stop, finding
    assert "also hold within the tolerance" in finding.note
    noisy = measure_loss_normalisation(
        lambda b: LOSSES["label_tokens"](b) * (1 + 0.05 * len(b["x"]) % 3), window, take_rows=take_rows,
        concat=concat_window, prior="rows", tolerance=0.9,
    )  # fmt: skip
    assert noisy.stop, noisy
