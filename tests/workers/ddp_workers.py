"""Functions run in 2 gloo processes by `accelerate.debug_launcher` (see tests/test_distributed.py). Each asserts
inside the worker; a failure in any rank fails the launcher."""

from __future__ import annotations

import copy
import json
import os

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from transformers import default_data_collator

from hf_gradaccum import GradAccumArguments, GradAccumTrainer, GradientAccumulator, count_items_in_batch
from tests.multiprocess import ROOT
from tests.parity_cases import CASES, large_batch_reference, relative_update_error

CASE_BY_NAME = {c.name: c for c in CASES}
RTOL = 1e-5

# Per rank, the sample indices of each micro-batch of one window: uneven micro-batches, and (for the causal LM, whose
# rows have different lengths) different token counts on the two ranks.
LAYOUT = {0: [[0, 1, 2], [3]], 1: [[4], [5, 6, 7, 8, 9]]}


class CommCounter:
    """A DDP communication hook that counts the bucket all-reduces DDP itself performs."""

    def __init__(self):
        self.calls = 0

    def hook(self, state, bucket):
        self.calls += 1
        tensor = bucket.buffer()
        tensor.div_(torch.distributed.get_world_size())
        return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def fresh_accelerate_state() -> None:
    """The launcher forks the pytest process, whose Accelerate singletons may describe an earlier 1-process run."""
    AcceleratorState._reset_state(reset_partial_state=True)


def plain_loop_parity(case_name: str, out_dir: str, offload: str = "false") -> None:
    """`offload="true"`: the accumulation buffer lives in host memory and is summed over ranks there (gloo);
    `offload="chunked"`: summed through the device in chunks, the path for process groups without a CPU backend."""
    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(10, torch.Generator().manual_seed(1))

    ddp_model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    counter = CommCounter()
    ddp_model.register_comm_hook(None, counter.hook)
    acc = GradientAccumulator(ddp_model, gradient_accumulation_steps=2, offload_accumulation_buffer=offload != "false")
    if offload == "chunked":
        acc.buffers.reduce_on_host, acc.buffers.all_reduce_chunk_numel = False, 1000
    for indices in LAYOUT[rank]:
        batch = default_data_collator([data[i] for i in indices])
        with acc.accumulate(ddp_model):
            loss = ddp_model(**batch).loss
            acc.backward(loss, num_items=count_items_in_batch(batch, shift_labels=case.shift_labels))
    result = acc.step(optimizer)

    reference = large_batch_reference(case, initial, data, [list(range(10))])
    err = relative_update_error(initial, accelerator.unwrap_model(ddp_model), reference)
    local_items = sum(
        count_items_in_batch(default_data_collator([data[i] for i in ix]), shift_labels=case.shift_labels)
        for ix in LAYOUT[rank]
    )
    # The stock path for comparison: plain DDP backward on every micro-batch, all-reducing each time.
    stock = accelerator.prepare(copy.deepcopy(initial))
    stock_counter = CommCounter()
    stock.register_comm_hook(None, stock_counter.hook)
    for indices in LAYOUT[rank]:
        batch = default_data_collator([data[i] for i in indices])
        stock(**batch).loss.backward()
    record = {
        "rank": rank,
        "err": err,
        "local_items": local_items,
        "window_items": result.num_items,
        "ddp_allreduces_ours": counter.calls,
        "flat_buffer_reductions_ours": acc.num_gradient_reductions,
        "collectives_ours": acc.num_collectives,
        "ddp_allreduces_stock": stock_counter.calls,
    }
    with open(os.path.join(out_dir, f"{case_name}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    assert err <= RTOL, record
    assert counter.calls == 0 and acc.num_gradient_reductions == 1, record


def trainer_parity(case_name: str, out_dir: str) -> None:
    """GradAccumTrainer under 2-process DDP vs the large-batch SGD steps over both ranks' samples."""
    fresh_accelerate_state()
    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(16, torch.Generator().manual_seed(2))
    # `average_tokens_across_devices=True`: the Trainer multiplies a `compute_loss_func`'s loss by the ranks.
    args = sgd_trainer_args(
        os.path.join(out_dir, "trainer"), gradient_accumulation_steps=2, average_tokens_across_devices=True
    )
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data, compute_loss_func=case.compute_loss_func)
    trainer.train()
    rank = trainer.args.process_index
    # Accelerate deals sequential batches of 2 round-robin over the ranks: a window (2 micro-batches x 2 ranks)
    # covers 8 consecutive samples.
    reference = large_batch_reference(case, initial, data, [list(range(0, 8)), list(range(8, 16))])
    err = relative_update_error(initial, trainer.model, reference)
    record = {"rank": rank, "err": err, "reductions": trainer.accumulator.num_gradient_reductions}
    with open(os.path.join(out_dir, f"trainer_{case_name}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    assert trainer.state.global_step == 2
    assert trainer.accumulator.num_gradient_reductions == 2
    assert err <= RTOL, record


def fp16_overflow_consistency(policy: str, inject: str, out_dir: str) -> None:
    """fp16 (CPU autocast) + dynamic loss scaling on 2 ranks; with `inject == "yes"` only rank 1's micro-batch 2 of
    the first window overflows (a regression label of 300: its scaled gradient exceeds fp16's range, its loss does
    not). Checks that both ranks take the same decision and end bitwise identical."""
    from hf_gradaccum import DynamicLossScaler

    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    case = CASE_BY_NAME["bert_regression"]
    torch.manual_seed(0)
    model = case.make_model()
    initial = copy.deepcopy(model)
    data = case.make_data(32, torch.Generator().manual_seed(3))  # 2 windows x 2 ranks x 4 micro-batches x 2
    labels = list(data["labels"])
    overflow_sample = 8 + 2 * 2  # rank 1's share of window 1 starts at 8; its micro-batch 2 starts at 12
    if inject == "yes":
        labels[overflow_sample] = 300.0
    data = data.remove_columns("labels").add_column("labels", labels)

    ddp_model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1)
    acc = GradientAccumulator(ddp_model, 4, loss_scaler=scaler, overflow_policy=policy)
    window_samples = []
    for window in range(2):
        base = window * 16 + rank * 8
        for micro in range(4):
            indices = list(range(base + 2 * micro, base + 2 * micro + 2))
            batch = default_data_collator([data[i] for i in indices])

            def compute_loss(batch=batch):
                with torch.autocast("cpu", dtype=torch.float16):
                    return ddp_model(**batch).loss

            with acc.accumulate(ddp_model):
                if policy == "recompute":
                    acc.accumulate_micro_batch(compute_loss, num_items=2)
                else:
                    acc.backward(compute_loss(), num_items=2)
        acc.step(optimizer)
        window_samples.append(list(range(window * 16, window * 16 + 16)))

    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(ddp_model).parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    scales = [None] * world
    torch.distributed.all_gather_object(scales, scaler.scale)
    record = {
        "rank": rank,
        "weights_bitwise_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "scales": scales,
        "applied": acc.applied_steps,
        "skipped": dict(acc.skipped_steps),
        "recomputed": acc.recomputed_micro_batches,
        "gradient_reductions": acc.num_gradient_reductions,
        "collectives": acc.num_collectives,
        "unchanged": torch.equal(flat, torch.cat([p.detach().flatten() for p in initial.parameters()])),
    }
    if policy == "recompute":
        reference = large_batch_reference(case, initial, data, window_samples, lr=1e-3)
        record["err"] = relative_update_error(initial, accelerator.unwrap_model(ddp_model), reference)
    with open(os.path.join(out_dir, f"fp16_{policy}_{inject}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def fsdp2_config_plugin_kwargs() -> dict:
    """The `fsdp_config` of configs/accelerate/fsdp2.yaml as `FullyShardedDataParallelPlugin` arguments (what
    `accelerate launch` passes through its environment), so the CPU tests shard the way the shipped config does."""
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp2.yaml").read_text())["fsdp_config"]
    renamed = {"transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap", "offload_params": "cpu_offload"}
    kwargs = {renamed.get(k.removeprefix("fsdp_"), k.removeprefix("fsdp_")): v for k, v in config.items()}
    kwargs.pop("version")
    return kwargs


def use_accelerate_fsdp_on_cpu(fsdp_version: int) -> None:
    """
    Accelerate 1.15 sets FSDP up only for GPU-type devices: on CPU processes it keeps `MULTI_CPU` and drops the
    plugin. This flips that one gate in the live Accelerate state (call it after the arguments resolved their
    device); everything after it is Accelerate's and the Trainer's real FSDP code: `fsdp2_prepare_model`
    (`fully_shard` on gloo), FSDP2 clipping, and sharded (torch.distributed.checkpoint) checkpoints.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    Accelerator(cpu=True)
    kwargs = fsdp2_config_plugin_kwargs() if fsdp_version == 2 else {}
    plugin = FullyShardedDataParallelPlugin(**kwargs, fsdp_version=fsdp_version)
    AcceleratorState().distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def sgd_trainer_args(out_dir: str, **overrides) -> GradAccumArguments:
    """Plain SGD at lr 1, constant schedule, no clipping, sequential batches of 2 on CPU: one optimizer step per
    window is then exactly `weights - mean gradient`, which the large-batch references reproduce."""
    args = dict(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return GradAccumArguments(**{**args, **overrides})


def fsdp_trainer_args(out_dir: str, **overrides) -> GradAccumArguments:
    args = sgd_trainer_args(out_dir, **{"gradient_accumulation_steps": 3, "seed": 0, **overrides})
    _ = args.device  # resolves Accelerate's state before the FSDP gate is flipped
    return args


def full_weights(model: torch.nn.Module, like: torch.nn.Module) -> torch.nn.Module:
    """An unsharded copy of `like` holding `model`'s (possibly FSDP2-sharded) weights."""
    state = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    full = copy.deepcopy(like)
    full.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()})
    return full


def clipped_large_batch_reference(case, model, data, windows, max_norm: float) -> torch.nn.Module:
    """`large_batch_reference` with the large batch's gradient clipped to `max_norm` before each SGD step (lr=1)."""
    model = copy.deepcopy(model)
    model.train()
    for window in windows:
        model.zero_grad()
        model(**default_data_collator([data[i] for i in window])).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= p.grad
    return model


def trainer_fsdp2(case_name: str, out_dir: str) -> None:
    """GradAccumTrainer under Accelerate's FSDP2 plugin: parity with the large batch (windows of 3 micro-batches of 2
    rows per rank over 20 samples, so the last window is partial), with clipping on the global norm, and a resume
    from the sharded checkpoint of step 1 bitwise equal to the uninterrupted run. On CPU (gloo) Accelerate's device
    gate is flipped (`use_accelerate_fsdp_on_cpu`); on a GPU `accelerate launch --config_file
    configs/accelerate/fsdp2.yaml` sets FSDP2 up itself."""
    from hf_gradaccum.engine.sharded.fsdp2_buffers import is_dtensor

    fresh_accelerate_state()
    on_gpu = torch.cuda.is_available()
    case = CASE_BY_NAME[case_name]
    torch.manual_seed(0)
    initial = case.make_model()
    data = case.make_data(20, torch.Generator().manual_seed(2))
    # Accelerate deals sequential batches of 2 round-robin over the ranks, so a window covers 2 x 3 x world
    # consecutive samples.
    window = 2 * 3 * int(os.environ.get("WORLD_SIZE", "1"))
    windows = [list(range(i, min(i + window, 20))) for i in range(0, 20, window)]
    record: dict = {"windows": len(windows)}
    results = {}

    def make_trainer(name: str, model: torch.nn.Module, **overrides) -> GradAccumTrainer:
        args = fsdp_trainer_args(os.path.join(out_dir, name), use_cpu=not on_gpu, **overrides)
        if not on_gpu:
            use_accelerate_fsdp_on_cpu(2)
        trainer = GradAccumTrainer(model=model, args=args, train_dataset=data)
        assert trainer.is_fsdp_enabled
        return trainer

    for name, clip, schedule in (
        ("plain", 0.0, "every_micro_batch"),
        ("clipped", 0.05, "every_micro_batch"),
        ("once_per_window", 0.0, "once_per_window"),
    ):
        trainer = make_trainer(
            name,
            copy.deepcopy(initial),
            max_grad_norm=clip,
            fsdp_reduce_schedule=schedule,
            save_strategy="steps" if name == "plain" else "no",
            save_steps=1,
            logging_steps=1,
        )
        trainer.train()
        assert trainer.accumulator.sharded and all(is_dtensor(p) for p in trainer.model.parameters())
        schedule_in_use = trainer.accumulator.fsdp_schedule
        assert (schedule_in_use.name if schedule_in_use is not None else "every_micro_batch") == schedule
        assert trainer.state.global_step == len(windows)
        results[name] = full_weights(trainer.model, initial).cpu()
        if clip:
            reference = clipped_large_batch_reference(case, initial, data, windows, clip)
            record["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        else:
            reference = large_batch_reference(case, initial, data, windows)
        record[f"err_{name}"] = relative_update_error(initial, results[name], reference)
        policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
        record["mixed_precision"] = trainer.accelerator.mixed_precision
        record["reduce_dtype"] = None if policy is None else str(policy.reduce_dtype)
        fresh_accelerate_state()

    # Resume the unclipped run from its step-1 checkpoint (Accelerate's sharded DCP model and optimizer state, the
    # accumulator's state) into a model initialised with another seed: the final weights must be bitwise the same.
    torch.manual_seed(1)
    trainer = make_trainer("plain", case.make_model())
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "plain", "checkpoint-1"))
    resumed = full_weights(trainer.model, initial).cpu()
    record["resume_bitwise"] = all(
        torch.equal(a, b)
        for a, b in zip(resumed.state_dict().values(), results["plain"].state_dict().values(), strict=True)
    )
    record["rank"] = rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"fsdp2_trainer_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def sharded_engines_refused(out_dir: str) -> None:
    """FSDP1 through the Trainer is refused with a clear error; `fsdp=...` on CPU (which Accelerate does not shard)
    trains as DDP; FSDP2 (`fully_shard`) in a plain loop is accepted (its parity is tested in tests/test_fsdp2.py)."""
    from torch.distributed.fsdp import fully_shard

    fresh_accelerate_state()
    case = CASE_BY_NAME["bert_seq_cls"]
    messages = {}
    args = fsdp_trainer_args(os.path.join(out_dir, "fsdp1"))
    use_accelerate_fsdp_on_cpu(1)
    try:
        GradAccumTrainer(model=case.make_model(), args=args, train_dataset=case.make_data(4, torch.Generator()))
    except ValueError as error:
        messages["fsdp1"] = str(error)
    fresh_accelerate_state()
    args = fsdp_trainer_args(os.path.join(out_dir, "cpu"), fsdp="full_shard")
    trainer = GradAccumTrainer(model=case.make_model(), args=args, train_dataset=case.make_data(4, torch.Generator()))
    messages["cpu_fsdp_enabled"] = trainer.is_fsdp_enabled
    torch.distributed.barrier()
    model = case.make_model()
    fully_shard(model)
    try:
        messages["plain_sharded"] = GradientAccumulator(model, 2).sharded
    except ValueError as error:
        messages["plain"] = str(error)
    partly = case.make_model()
    fully_shard(partly.bert)  # the classifier stays a plain tensor: its gradient would never be reduced
    try:
        GradientAccumulator(partly, 2)
    except ValueError as error:
        messages["partly_sharded"] = str(error)
    try:
        GradientAccumulator(model, 2, reduce_gradients=False)
    except ValueError as error:
        messages["no_reduce_sharded"] = str(error)
    messages["zero_item_masked_mean"] = masked_mean_with_an_item_less_micro_batch()
    # Under Accelerate's FSDP2 with 2 processes: an OOM retry on one rank would desynchronise the collectives.
    fresh_accelerate_state()
    args = fsdp_trainer_args(os.path.join(out_dir, "oom"), use_cpu=True, auto_find_batch_size=True)
    use_accelerate_fsdp_on_cpu(2)
    try:
        GradAccumTrainer(model=case.make_model(), args=args, train_dataset=case.make_data(4, torch.Generator()))
    except ValueError as error:
        messages["fsdp2_auto_find_batch_size"] = str(error)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"refused_rank{rank}.json"), "w") as f:
        json.dump(messages, f)


def masked_mean_with_an_item_less_micro_batch() -> dict:
    """FSDP2, a hand-written masked-mean loss, rank 1's 2nd micro-batch without items: the weight-0 backward that keeps
    the collectives paired carries NaN gradients (0/0), so the window is skipped on both ranks, never applied, and
    the warning names the cause and the fix."""
    import logging

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fully_shard(model)
    before = [p.full_tensor().clone() for p in model.parameters()]
    acc = GradientAccumulator(model, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hf_gradaccum.engine.accumulator").addHandler(handler)
    try:
        for micro in range(2):
            x = torch.randn(5, 4)
            mask = torch.zeros(5) if (rank, micro) == (1, 1) else torch.ones(5)
            per_row = torch.nn.functional.cross_entropy(model(x), torch.zeros(5, dtype=torch.long), reduction="none")
            acc.backward((per_row * mask).sum() / mask.sum(), num_items=int(mask.sum()))
        applied = acc.step(optimizer).applied
    finally:
        logging.getLogger("hf_gradaccum.engine.accumulator").removeHandler(handler)
    after = [p.full_tensor() for p in model.parameters()]
    return {
        "applied": applied,
        "skipped": dict(acc.skipped_steps),
        "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "hint_logged": any("clamp(min=1)" in m for m in records),
    }


class TwoHeads(torch.nn.Module):
    """A body and two heads: each rank's samples use one head, so each head gets a gradient on one rank only; a
    third head is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(3))

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](torch.tanh(self.body(x)))


def in_place_rank_specific_parameters(out_dir: str) -> None:
    """The in-place path under DDP (no_sync, one bucketed all-reduce of `.grad` per window): a parameter with a
    gradient on one rank only is summed with the other rank's zeros; one with none on any rank keeps `.grad = None`,
    so AdamW (weight decay 0.5) leaves it as the large batch does. Against the hook path and the hand-computed large
    batch over both ranks' samples."""
    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    initial = TwoHeads()
    g = torch.Generator().manual_seed(5)
    # Rank r's micro-batches (rows) all use head r.
    sizes = {0: [3, 1], 1: [2, 4]}
    data = {r: [(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)) for n in sizes[r]] for r in (0, 1)}
    total = sum(sum(sizes[r]) for r in (0, 1))

    reference = copy.deepcopy(initial)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    loss = sum(((reference(x, r) - y) ** 2).sum() for r in (0, 1) for x, y in data[r]) / total
    loss.backward()
    opt.step()

    record = {"rank": rank}
    for path in ("in_place", "hooks"):
        model = copy.deepcopy(initial)
        ddp_model, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        )
        acc = GradientAccumulator(ddp_model, gradient_accumulation_steps=2, accumulation_path=path)
        for x, y in data[rank]:
            with acc.accumulate(ddp_model):
                acc.backward(((ddp_model(x, rank) - y) ** 2).mean(), num_items=len(x))
        result = acc.step(optimizer)
        trained = accelerator.unwrap_model(ddp_model)
        record[path] = {
            "in_place": acc.in_place,
            "err": relative_update_error(initial, trained, reference),
            "window_items": result.num_items,
            "unused_unchanged": bool(torch.equal(trained.heads[2].weight, initial.heads[2].weight)),
            "reductions": acc.num_gradient_reductions,
        }
    with open(os.path.join(out_dir, f"in_place_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    for path in ("in_place", "hooks"):
        assert record[path]["err"] <= RTOL and record[path]["unused_unchanged"], record
    assert record["in_place"]["in_place"] and not record["hooks"]["in_place"], record
