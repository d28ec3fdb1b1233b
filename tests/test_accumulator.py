"""GradientAccumulator in a plain loop: parity with the large batch (rtol 1e-5, fp32), memory layout, bad input,
skipped windows, and state round trips."""

import copy
import logging

import pytest
import torch
from transformers import default_data_collator

from hf_gradaccum import GradientAccumulator, count_items_in_batch
from tests.parity_cases import CASES, large_batch_reference, relative_update_error

RTOL = 1e-5
CASE_BY_NAME = {c.name: c for c in CASES}


def _plain_loop(case, model, data, micro_sizes, steps, optimizer_cls=torch.optim.SGD, path="auto", **opt_kwargs):
    """Accumulate micro-batches of the given sizes (in order), one optimizer step per `steps` micro-batches, on the
    accumulation path `path`."""
    model = copy.deepcopy(model)
    model.train()
    optimizer = optimizer_cls(model.parameters(), lr=1.0, **opt_kwargs)
    acc = GradientAccumulator(model, gradient_accumulation_steps=steps, accumulation_path=path)
    start = 0
    for i, size in enumerate(micro_sizes):
        batch = default_data_collator([data[j] for j in range(start, start + size)])
        start += size
        acc.backward(model(**batch).loss, num_items=count_items_in_batch(batch, shift_labels=case.shift_labels))
        if acc.sync_gradients or i == len(micro_sizes) - 1:
            acc.step(optimizer)
    return model, acc


@pytest.mark.parametrize("name", ["bert_seq_cls", "bert_token_cls", "bert_mlm", "gpt2_causal_lm", "vit_image_cls"])
def test_plain_loop_uneven_micro_batches_match_large_batch(name):
    case = CASE_BY_NAME[name]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(17, torch.Generator().manual_seed(3))
    # Windows [5, 1, 4] and [7]: uneven micro-batches and a partial last window.
    micro_sizes, steps = [5, 1, 4, 7], 3
    trained, acc = _plain_loop(case, model, data, micro_sizes, steps)
    reference = large_batch_reference(case, model, data, [list(range(10)), list(range(10, 17))])
    err = relative_update_error(model, trained, reference)
    print(f"plain loop {name}: relative update error {err:.2e}")
    assert err <= RTOL
    assert acc.applied_steps == 2


def test_grad_is_a_view_of_the_fp32_buffer_no_second_copy():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    acc = GradientAccumulator(model, 2, accumulation_path="hooks")
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(3, 4)).sum(), num_items=3)
        if _ == 0:
            # Between micro-batches the gradient lives only in the buffer.
            assert all(p.grad is None for p in model.parameters())
    acc.finish_window()
    (buffer,) = acc.buffers.flat.values()
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_bf16_parameters_accumulate_in_fp32_and_step_in_bf16():
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    acc = GradientAccumulator(model, 2)
    assert next(iter(acc.buffers.flat.values())).dtype == torch.float32
    for _ in range(2):
        acc.backward(model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).mean(), num_items=3)
    acc.finish_window()
    assert model.weight.grad.dtype == torch.bfloat16


def test_unused_parameters_get_no_gradient():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    acc = GradientAccumulator(model, 1)
    acc.backward(model["used"](torch.randn(2, 3)).sum(), num_items=2)
    acc.finish_window()
    assert model["used"].weight.grad is not None
    assert model["unused"].weight.grad is None  # AdamW must not decay/momentum-update it, as in the large batch


@pytest.mark.parametrize("steps", [0, -1, 1.5, "4", True, None])
def test_bad_accumulation_steps(steps):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradientAccumulator(torch.nn.Linear(2, 2), steps)


@pytest.mark.parametrize("dtype", ["float8", "int32", torch.int64, 3])
def test_bad_accumulation_dtype(dtype):
    with pytest.raises(ValueError, match="accumulation_dtype.*float32"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, accumulation_dtype=dtype)


def test_bad_overflow_policy_and_num_items():
    with pytest.raises(ValueError, match="overflow_policy"):
        GradientAccumulator(torch.nn.Linear(2, 2), 2, overflow_policy="retry")
    acc = GradientAccumulator(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="num_items"):
        acc.backward(torch.tensor(1.0, requires_grad=True), num_items=-1)


def _adamw_snapshot(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    return weights, state


def _assert_untouched(model, optimizer, snapshot):
    weights, state = snapshot
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w)
    assert str(optimizer.state_dict()) == str(state)


def test_window_with_zero_items_is_skipped(caplog):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, 2)
    # One applied window first, so there is optimizer state to protect.
    for _ in range(2):
        acc.backward(torch.nn.functional.cross_entropy(model(torch.randn(2, 4)), torch.tensor([0, 1])), num_items=2)
    acc.step(optimizer)
    snapshot = _adamw_snapshot(model, optimizer)
    labels = torch.tensor([-100, -100])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(2, 4)), labels)  # nan: 0/0
            acc.backward(loss, num_items=count_items_in_batch({"labels": labels}))
        result = acc.step(optimizer)
    assert not result.applied and result.skip_reason == "no_items"
    assert "no_items" in caplog.text
    _assert_untouched(model, optimizer, snapshot)
    assert acc.metrics()["accumulator/skipped_no_items"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_loss_skips_window_and_leaves_weights_and_optimizer(bad):
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    acc = GradientAccumulator(model, 2)
    for _ in range(2):
        acc.backward(model(torch.randn(2, 4)).pow(2).mean(), num_items=2)
    acc.step(optimizer, scheduler)
    snapshot = _adamw_snapshot(model, optimizer)
    lr = scheduler.get_last_lr()
    acc.backward(model(torch.randn(2, 4)).pow(2).mean(), num_items=2)
    acc.backward(model(torch.randn(2, 4)).pow(2).mean() * bad, num_items=2)
    result = acc.step(optimizer, scheduler)
    assert not result.applied and result.skip_reason == "non_finite_loss"
    _assert_untouched(model, optimizer, snapshot)
    assert scheduler.get_last_lr() == lr
    # The next window trains normally again.
    for _ in range(2):
        acc.backward(model(torch.randn(2, 4)).pow(2).mean(), num_items=2)
    assert acc.step(optimizer, scheduler).applied
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert acc.applied_steps == 2 and acc.skipped_steps["non_finite_loss"] == 1


def test_plain_backward_outside_the_accumulator_is_refused_at_window_end():
    model = torch.nn.Linear(2, 1)
    acc = GradientAccumulator(model, 2)
    acc.backward(model(torch.randn(1, 2)).sum(), num_items=1)
    model(torch.randn(1, 2)).sum().backward()  # forgot acc.backward: .grad holds an unweighted gradient
    with pytest.raises(RuntimeError, match="accumulator.backward"):
        acc.finish_window()


def test_state_dict_round_trip_mid_window_gives_the_same_step():
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(12, torch.Generator().manual_seed(5))
    batches = [default_data_collator([data[j] for j in range(i, i + 4)]) for i in range(0, 12, 4)]

    uninterrupted = copy.deepcopy(model)
    acc = GradientAccumulator(uninterrupted, 3)
    for b in batches:
        acc.backward(uninterrupted(**b).loss, num_items=4)
    acc.step(torch.optim.SGD(uninterrupted.parameters(), lr=1.0))

    first = copy.deepcopy(model)
    acc1 = GradientAccumulator(first, 3)
    for b in batches[:2]:
        acc1.backward(first(**b).loss, num_items=4)
    saved = copy.deepcopy(acc1.state_dict())
    resumed = copy.deepcopy(model)  # "a new process": fresh parameters, the accumulator state loaded
    acc2 = GradientAccumulator(resumed, 3)
    acc2.load_state_dict(saved)
    acc2.backward(resumed(**batches[2]).loss, num_items=4)
    assert acc2.sync_gradients
    acc2.step(torch.optim.SGD(resumed.parameters(), lr=1.0))
    for p, q in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradientAccumulator(copy.deepcopy(model), 4).load_state_dict(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_check_is_exact_even_when_the_fast_sum_overflows(dtype):
    from hf_gradaccum.engine.buffers import all_finite as _all_finite

    big = torch.finfo(dtype).max
    assert _all_finite(torch.full((1000,), big, dtype=dtype))  # the sum overflows; every element is finite
    assert _all_finite(torch.zeros(10, dtype=dtype))
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        tensor = torch.ones(1000, dtype=dtype)
        tensor[: len(bad)] = torch.tensor(bad, dtype=dtype)
        assert not _all_finite(tensor), bad


# ------------------------------------------------------------------ `backward(loss, batch=...)` and `flush`
def _batches(data, micro_sizes):
    """A generator of collated micro-batches: a loader without `len()`."""
    start = 0
    for size in micro_sizes:
        yield default_data_collator([data[j] for j in range(start, start + size)])
        start += size


def _loop_counting_with(model, loader, steps, count):
    """The README's plain loop: step at each full window, `flush` the partial one after the loop."""
    model = copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = GradientAccumulator(model, gradient_accumulation_steps=steps)
    for batch in loader:
        loss = model(**batch).loss
        if count == "batch":
            acc.backward(loss, batch=batch)
        else:
            acc.backward(loss, num_items=count(batch))
        if acc.sync_gradients:
            acc.step(optimizer)
    flushed = acc.flush(optimizer)
    return model, acc, flushed


@pytest.mark.parametrize("name", ["gpt2_causal_lm", "bert_seq_cls", "bert_token_cls"])
def test_backward_with_batch_counts_items_as_the_model_does(name):
    case = CASE_BY_NAME[name]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(17, torch.Generator().manual_seed(3))
    micro_sizes, steps = [5, 1, 4, 7], 3  # windows [5, 1, 4] and [7]: the last one partial, found by `flush`
    reference = large_batch_reference(case, model, data, [list(range(10)), list(range(10, 17))])

    trained, acc, flushed = _loop_counting_with(model, _batches(data, micro_sizes), steps, "batch")
    assert acc.loss_shifts_labels is case.shift_labels
    err = relative_update_error(model, trained, reference)
    print(f"backward(batch=) {name}: relative update error {err:.2e}")
    assert err <= RTOL
    assert acc.applied_steps == 2 and flushed is not None and flushed.micro_steps == 1

    if case.shift_labels:
        # The trap `batch=` removes: counting a causal LM's labels unshifted over-counts by one token per row.
        naive, _, _ = _loop_counting_with(model, _batches(data, micro_sizes), steps, count_items_in_batch)
        naive_err = relative_update_error(model, naive, reference)
        print(f"count_items_in_batch unshifted {name}: relative update error {naive_err:.2e}")
        assert naive_err > 100 * RTOL


def test_flush_after_a_loader_without_len_steps_the_partial_window_once():
    case = CASE_BY_NAME["bert_seq_cls"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(11, torch.Generator().manual_seed(5))

    class Loader:  # iterable, no `__len__`
        def __iter__(self):
            return _batches(data, [3, 3, 3, 2])

    assert not hasattr(Loader(), "__len__")
    # Windows [3, 3] and [3, 2]... with steps=3: [3, 3, 3] and the partial [2].
    trained, acc, flushed = _loop_counting_with(model, Loader(), 3, count_items_in_batch)
    reference = large_batch_reference(case, model, data, [list(range(9)), [9, 10]])
    err = relative_update_error(model, trained, reference)
    print(f"flush of a partial window: relative update error {err:.2e}")
    assert err <= RTOL
    assert flushed.applied and flushed.micro_steps == 1 and flushed.num_items == 2
    assert acc.applied_steps == 2

    # Nothing pending: a no-op that leaves the optimizer's state alone.
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1.0)
    snapshot = _adamw_snapshot(trained, optimizer)
    assert acc.flush(optimizer) is None
    _assert_untouched(trained, optimizer, snapshot)


def test_flush_is_a_no_op_after_a_full_last_window():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, 2)
    for _ in range(4):
        acc.backward(model(torch.randn(3, 2)).pow(2).mean(), num_items=3)
        if acc.sync_gradients:
            acc.step(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    assert acc.flush(optimizer) is None
    assert acc.applied_steps == 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_backward_with_batch_refuses_what_it_cannot_count():
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, 3, dtype=torch.long)}
    model = torch.nn.Linear(2, 1)
    loss = model(torch.randn(2, 2)).mean()
    for acc, match in [
        (GradientAccumulator(list(model.parameters()), 2), "given parameters"),
        (GradientAccumulator(model, 2), "`Linear` that is not a transformers model"),
    ]:
        assert acc.loss_shifts_labels is None
        with pytest.raises(ValueError, match=match) as excinfo:
            acc.backward(loss, batch=batch)
        assert "num_items" in str(excinfo.value)
        with pytest.raises(ValueError, match="num_items"):
            acc.accumulate_micro_batch(lambda: loss, batch=batch)
        assert acc.micro_step == 0  # refused before any work
    gpt2 = CASE_BY_NAME["gpt2_causal_lm"].make_model()
    acc = GradientAccumulator(gpt2, 2)
    with pytest.raises(ValueError, match="either `num_items` or `batch`"):
        acc.backward(loss, num_items=3, batch=batch)
    with pytest.raises(ValueError, match="`batch` must be a mapping"):
        acc.backward(loss, batch=[1, 2])
    assert acc.micro_step == 0


def test_accumulate_micro_batch_with_batch_counts_shifted_items():
    case = CASE_BY_NAME["gpt2_causal_lm"]
    torch.manual_seed(0)
    model = case.make_model()
    data = case.make_data(6, torch.Generator().manual_seed(1))
    acc = GradientAccumulator(model, 2)
    for batch in _batches(data, [4, 2]):
        acc.accumulate_micro_batch(lambda batch=batch: model(**batch).loss, batch=batch)
    result = acc.finish_window()
    labels = default_data_collator([data[j] for j in range(6)])["labels"]
    assert result.num_items == int(labels[:, 1:].ne(-100).sum())


def test_engine_recognises_causal_lms_by_duck_typing_alone():
    """The engine's inspection (no transformers registries) on what `batch=` meets: wrappers, heads, a loss set on
    the instance."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    from hf_gradaccum.engine.model_inspection import loss_shifts_labels

    gpt2 = CASE_BY_NAME["gpt2_causal_lm"].make_model()
    config = BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    bert_cls, bert_mlm = BertForSequenceClassification(config), BertForMaskedLM(config)
    assert loss_shifts_labels(gpt2) is True
    assert loss_shifts_labels(torch.compile(gpt2)) is True
    assert loss_shifts_labels(torch.nn.DataParallel(gpt2)) is True
    assert loss_shifts_labels(bert_cls) is False
    assert loss_shifts_labels(bert_mlm) is False
    assert loss_shifts_labels(torch.nn.Linear(2, 2)) is None

    def ForCausalLMLoss(*args, **kwargs):  # noqa: N802 - the name is what is recognised
        raise AssertionError("not called")

    bert_mlm.loss_function = ForCausalLMLoss
    assert loss_shifts_labels(bert_mlm) is True
