"""HSDP and tensor parallelism as transformers and Accelerate set them up, under the stock `Trainer` and
`GradAccumTrainer` at gradient accumulation `STEPS`, each against the hand-computed large batch on the same samples.

Routes (the launch's world size must match each route's mesh):

- `hsdp` (4 ranks): `from_pretrained(..., distributed_config=DistributedConfig(dp_replicate_size=2, fsdp_size=2))`;
- `tp` (2 ranks): `DistributedConfig(tp_size=2)`; `tp_plan_auto` (2 ranks): `from_pretrained(..., tp_plan="auto")`;
- `tp_fsdp` (4 ranks): `DistributedConfig(tp_size=2, fsdp_size=2)`;
- `pc_tp` (2 ranks): Accelerate's `ParallelismConfig(tp_size=2)` in the arguments, on a `tp_plan="auto"` model;
- `tp_bf16` (2 ranks): bf16 parameters under `DistributedConfig(tp_size=2)`, the gradient's error at 64 micro-batches
  against the one-pass floor (`bf16_accumulation`);
- `engine_tp_dp` (4 ranks): the plain `GradientAccumulator` on a 2 x 2 (`dp`, `tp`) mesh (`plain_engine_tp_dp`);
- `pc_hsdp` (4 ranks): `ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)` with Accelerate's FSDP2 plugin
  sharding a plain model.

On `hsdp` and `tp` also TRL's `SFTTrainer` composed (`class SFTGradAccum(GradAccumTrainer, SFTTrainer)`, against the
stock `SFTTrainer`) on the causal LM's rows, and a PEFT LoRA model (`get_peft_model` after `from_pretrained`) on
`hsdp`, `pc_hsdp` (where Accelerate's FSDP2 plugin shards the PEFT model) and `tp` (`COMPOSED_CASES`).

Each route trains one window on a dataset of exactly one window (so the large batch is every row, whatever order the
sampler deals them in) for two tiny random Llama models, a causal LM (rows of different lengths) and a sequence
classifier; on the FSDP2 routes `GradAccumTrainer` also with `fsdp_reduce_schedule="once_per_window"`. Rank 0 writes `OUT_DIR/ROUTE.json`: the relative update error (or the error message) per model and
trainer.

On CPU only Accelerate's device checks are lifted (`lift_accelerate_device_checks`); everything behind them runs.

Usage: torchrun --nproc_per_node N tests/workers/hsdp_tp.py OUT_DIR ROUTE [ROUTE ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from accelerate.state import AcceleratorState  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Trainer,
    TrainerCallback,
)
from transformers.distributed import DistributedConfig  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.sharded.fsdp2_buffers import fsdp2_modules  # noqa: E402

MICRO, STEPS, SEQ, VOCAB, LABELS = 2, 3, 10, 64, 3

# Per route: what `from_pretrained` gets, the `ParallelismConfig` sizes for the arguments, how many ranks see
# different batches, and whether Accelerate's FSDP2 plugin shards the model.
ROUTES: dict[str, dict[str, Any]] = {
    "hsdp": dict(load=dict(distributed_config=dict(dp_replicate_size=2, fsdp_size=2)), dp=4),
    "tp": dict(load=dict(distributed_config=dict(tp_size=2)), dp=1),
    "tp_plan_auto": dict(load=dict(tp_plan="auto"), dp=1),
    "tp_fsdp": dict(load=dict(distributed_config=dict(tp_size=2, fsdp_size=2)), dp=2),
    "pc_tp": dict(load=dict(tp_plan="auto"), parallelism=dict(tp_size=2), dp=1),
    "pc_hsdp": dict(load={}, parallelism=dict(dp_replicate_size=2, dp_shard_size=2), dp=4, accelerate_fsdp=True),
}
FSDP_ROUTES = ("hsdp", "tp_fsdp", "pc_hsdp")
MODELS = {"causal_lm": (LlamaForCausalLM, AutoModelForCausalLM), "seq_cls": (LlamaForSequenceClassification, None)}
# Further cases on the causal LM, per route (they share its saved model and rows): TRL's `SFTTrainer` composed with
# ours (`SFTGradAccum`) next to the stock `SFTTrainer`, and a PEFT LoRA model (`get_peft_model` right after
# `from_pretrained`, as a script would: on `hsdp` and `tp` the model is sharded by then, on `pc_hsdp` Accelerate shards
# the PEFT model later) under both plain trainers.
COMPOSED_CASES: dict[str, tuple[str, ...]] = {"hsdp": ("sft", "lora"), "pc_hsdp": ("lora",), "tp": ("sft", "lora")}


def lift_accelerate_device_checks() -> None:
    """
    Accelerate 1.15 accepts a `ParallelismConfig` (which the Trainer also builds itself for a model loaded with
    `tp_size > 1`) only where `Accelerator.multi_device` lists the distributed type, a list of GPU-type devices, so
    CPU processes (`MULTI_CPU`) are refused by that check alone. Count `MULTI_CPU` in. The device mesh, the DTensor
    parameters, the data sharding and every collective behind it are the real ones (gloo).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    listed = Accelerator.multi_device.fget
    Accelerator.multi_device = property(
        lambda self: listed(self) or (self.use_distributed and self.distributed_type == DistributedType.MULTI_CPU)
    )


def use_accelerate_fsdp2_on_cpu(parallelism_config: Any) -> None:
    """Accelerate sets FSDP up only for GPU-type devices (`AcceleratorState.__init__` on `MULTI_CPU` keeps neither
    the FSDP plugin nor the `ParallelismConfig`): flip its distributed type to FSDP2 and hand it the config, as it
    would on a GPU (the same gate the FSDP2 Trainer test lifts). Its `fsdp2_prepare_model` then shards the model on
    the config's 2-D (`dp_replicate`, `dp_shard_cp`) mesh."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]
    )
    AcceleratorState().distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin
    AcceleratorState().parallelism_config = parallelism_config
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


class ReduceScatterCounter:
    """Counts FSDP2's gradient reduce-scatters: FSDP2 calls `torch.distributed.reduce_scatter_single` (torch 2.13;
    `reduce_scatter_tensor` in torch 2.11) through the module attribute, which this wraps; the collective itself runs
    unchanged."""

    def __init__(self) -> None:
        self.calls = 0
        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self._reduce_scatter = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._reduce_scatter(*args, **kwargs)

        setattr(dist, name, counted)


def save_models(root: str) -> None:
    """Rank 0 saves the tiny random Llama models (2 KV heads, so `tp_size=2` divides every projection)."""
    if dist.get_rank() == 0:
        for name, (cls, _) in MODELS.items():
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
                num_labels=LABELS,
                pad_token_id=0,
            )
            cls(config).save_pretrained(os.path.join(root, name))
    dist.barrier()


def dataset(model_name: str, rows: int) -> list[dict[str, torch.Tensor]]:
    """Rows of different lengths, right-padded to `SEQ` with token 0: for the causal LM with labels -100 on the
    padding (micro-batches and ranks hold different numbers of tokens), for the classifier one label per row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(rows):
        length = 3 + (5 * i) % (SEQ - 2)
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        if model_name == "causal_lm":
            labels = ids.masked_fill(mask == 0, -100)
        else:
            labels = torch.randint(0, LABELS, (), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def load(path: str, **kwargs: Any) -> torch.nn.Module:
    if "distributed_config" in kwargs:
        kwargs["distributed_config"] = DistributedConfig(**kwargs["distributed_config"])
    auto = AutoModelForCausalLM if path.endswith("causal_lm") else AutoModelForSequenceClassification
    return auto.from_pretrained(path, dtype=torch.float32, **kwargs)


def large_batch_reference(model: str | torch.nn.Module, rows: list[dict[str, torch.Tensor]]) -> tuple[dict, dict]:
    """One SGD step (lr 1) on all rows at once, unsharded, in fp64: the model's own mean loss over the whole batch
    (a causal LM's over every row's shifted labels). `model` is a saved model's path or an unsharded model."""
    model = (load(model) if isinstance(model, str) else model).double()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    model(**batch).loss.backward()
    # Frozen parameters (a LoRA model's base weights) stay as they are.
    return initial, {n: (p - p.grad if p.requires_grad else p).detach() for n, p in model.named_parameters()}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensor shards and replicas alike), in fp64."""
    params = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double() for n, p in params.items()}


def relative_error(weights: dict, initial: dict, ref: dict) -> float:
    """|weights - ref| / |ref - initial| over all parameters (L2)."""
    diff = sum(float((weights[n] - ref[n]).pow(2).sum()) for n in ref) ** 0.5
    update = sum(float((ref[n] - initial[n]).pow(2).sum()) for n in ref) ** 0.5
    return diff / update


def layout(trainer: Trainer) -> dict[str, Any]:
    """How the trained model is laid out (mesh dimensions and placements of its DTensor parameters) and, for
    `GradAccumTrainer`, what its accumulator holds: the test checks that each route sharded what it claims."""
    meshes, placements = set(), set()
    for p in trainer.model.parameters():
        if hasattr(p, "device_mesh"):
            meshes.add(",".join(p.device_mesh.mesh_dim_names or ()))
            placements.add(",".join(type(x).__name__ for x in p.placements))
    info: dict[str, Any] = {"meshes": sorted(meshes), "placements": sorted(placements)}
    accumulator = getattr(trainer, "accumulator", None)
    if accumulator is not None:
        buffers = accumulator.buffers
        info["buffers"] = type(buffers).__name__
        info["buffer_dtype"] = str(buffers.dtype)
        info["buffer_numel"] = sum(b.numel() for b in buffers.flat.values())
        info["local_numel"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in accumulator.parameters
        )
        info["full_numel"] = sum(p.numel() for p in accumulator.parameters)
        info["window_reductions"] = accumulator.num_gradient_reductions
        info["window_collectives"] = accumulator.num_collectives
    return info


def lora(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA on the attention's q/v projections, the same random init on every rank and in the reference (B random
    too, so both matrices get a gradient on the first step)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(model, config)


def sft_dataset(rows: list[dict[str, torch.Tensor]]) -> Any:
    """The causal LM's rows unpadded, as a tokenized dataset: `SFTTrainer`'s collator pads them again (with token 0,
    labels -100 there), so its large batch is the causal LM's."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [r["input_ids"][r["attention_mask"] == 1].tolist() for r in rows]})


def composed_sft_trainer() -> type:
    from trl import SFTTrainer

    class SFTGradAccum(GradAccumTrainer, SFTTrainer):
        pass

    return SFTGradAccum


def make_trainer(case: str, trainer_cls: type, model: torch.nn.Module, args: Any, rows: list) -> Trainer:
    if case != "sft":
        return trainer_cls(model=model, args=args, train_dataset=rows)
    from trl import SFTTrainer

    from tests.composition_cases import word_tokenizer

    cls = composed_sft_trainer() if trainer_cls is GradAccumTrainer else SFTTrainer
    tokenizer = word_tokenizer()  # only its pad token (id 0) is used: the rows are tokenized already
    return cls(model=model, args=args, train_dataset=sft_dataset(rows), processing_class=tokenizer)


def train_once(
    trainer_cls: type, path: str, route: str, rows: list, out_dir: str, case: str = "", **overrides: Any
) -> tuple[dict, dict]:
    spec = ROUTES[route]
    AcceleratorState._reset_state(reset_partial_state=True)
    model = load(path, **spec["load"])
    if case == "lora":
        model = lora(model)
    extra = {}
    if "parallelism" in spec:
        from accelerate import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(**spec["parallelism"])
    arguments_cls = GradAccumArguments
    if case == "sft":
        from tests.composed_arguments import GradAccumSFTConfig

        arguments_cls, extra["bf16"] = GradAccumSFTConfig, False  # SFTConfig would default to bf16
    args = arguments_cls(
        output_dir=os.path.join(out_dir, f"{route}_{case}_{trainer_cls.__name__}"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=STEPS,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **extra,
        **overrides,
    )
    if spec.get("accelerate_fsdp"):
        _ = args.device  # resolves Accelerate's state before the FSDP gate is flipped
        use_accelerate_fsdp2_on_cpu(args.parallelism_config)
    trainer = make_trainer(case, trainer_cls, model, args, rows)
    start = REDUCE_SCATTERS.calls
    trainer.train()
    info = layout(trainer)
    info["reduce_scatters"] = REDUCE_SCATTERS.calls - start
    info["fsdp_modules"] = len(fsdp2_modules(trainer.model))
    return full_parameters(trainer.model), info


# What each route must refuse at construction (or, for the plain engine, when the accumulator is built): the
# arguments it is given, and the record key its message goes under.
REFUSALS: dict[str, dict[str, dict[str, Any]]] = {
    "tp": {
        "verify": dict(verify_accumulation="first_step"),
        "oom_retry": dict(auto_find_batch_size=True),
        "once_per_window": dict(fsdp_reduce_schedule="once_per_window"),
    },
    "hsdp": {"once_per_window_fp16_recompute": dict(fsdp_reduce_schedule="once_per_window", fp16=True)},
}


def refusals(route: str, out_dir: str) -> dict[str, str]:
    """The messages of what `route` refuses before any training step (`"accepted"` if it was not refused)."""
    messages = {}
    path = os.path.join(out_dir, "causal_lm")
    for key, overrides in REFUSALS.get(route, {}).items():
        AcceleratorState._reset_state(reset_partial_state=True)
        model = load(path, **ROUTES[route]["load"])
        args = GradAccumArguments(
            output_dir=os.path.join(out_dir, f"refused_{key}"), report_to=[], save_strategy="no", **overrides
        )
        try:
            GradAccumTrainer(model=model, args=args, train_dataset=dataset("causal_lm", 4))
            messages[key] = "accepted"
        except ValueError as error:
            messages[key] = str(error)
    if route == "tp_fsdp":
        # The plain engine cannot know which ranks share a batch: without the group it must refuse, not double-count.
        from hf_gradaccum import GradientAccumulator

        try:
            GradientAccumulator(load(path, **ROUTES[route]["load"]), gradient_accumulation_steps=2)
            messages["engine_without_group"] = "accepted"
        except ValueError as error:
            messages["engine_without_group"] = str(error)
    return messages


REDUCE_SCATTERS = ReduceScatterCounter()
BF16_MICRO_BATCHES = 64


class GradientCapture(TrainerCallback):
    """The gradient the optimizer is about to step with, gathered whole in fp64 (every rank joins the gathers)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            self.grads[name] = grad.detach().double()


def bf16_accumulation(out_dir: str) -> dict[str, float]:
    """
    bf16 parameters under `DistributedConfig(tp_size=2)`, `BF16_MICRO_BATCHES` micro-batches of one row: the
    gradient each trainer steps with against the fp64 large-batch gradient (relative L2 error), and the floor, the
    stock Trainer's single bf16 pass over all rows at once. The stock Trainer sums the micro-batches' gradients in
    the parameters' bf16 `.grad`; `GradAccumTrainer` sums each rank's shards in fp32 and rounds once, at the end.
    """
    path = os.path.join(out_dir, "causal_lm")
    rows = dataset("causal_lm", BF16_MICRO_BATCHES)
    reference = load(path).double()
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    reference(**batch).loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    errors = {}
    runs = (
        ("one_pass", Trainer, BF16_MICRO_BATCHES, 1),
        ("stock", Trainer, 1, BF16_MICRO_BATCHES),
        ("ours", GradAccumTrainer, 1, BF16_MICRO_BATCHES),
    )
    for name, cls, micro, steps in runs:
        AcceleratorState._reset_state(reset_partial_state=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=2), dtype=torch.bfloat16
        )
        capture = GradientCapture()
        args = GradAccumArguments(
            output_dir=os.path.join(out_dir, f"bf16_{name}"),
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=steps,
            optim="sgd",
            max_grad_norm=0.0,
            max_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        cls(model=model, args=args, train_dataset=rows, callbacks=[capture]).train()
        diff = sum(float((capture.grads[n] - ref[n]).pow(2).sum()) for n in ref) ** 0.5
        errors[name] = diff / sum(float(g.pow(2).sum()) for g in ref.values()) ** 0.5
    return errors


def plain_engine_tp_dp() -> dict[str, Any]:
    """
    The plain engine on a 2 x 2 (`dp`, `tp`) mesh without FSDP2: a Colwise/Rowwise MLP (`parallelize_module` on the
    `tp` dimension) with a LayerNorm that stays a plain tensor on both tensor-parallel ranks, each data-parallel rank
    on its own micro-batches of different sizes. `GradientAccumulator(..., data_parallel_group=mesh["dp"].get_group())`
    sums the local shards and the items over the `dp` group once per window; compared with the fp64 large batch.
    """
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hf_gradaccum import GradientAccumulator

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.LayerNorm(4))

    g = torch.Generator().manual_seed(3)
    # data[dp_rank][micro] = (inputs, classes): 1 to 4 rows per micro-batch.
    data = [
        [(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]
        for sizes in ((1, 4, 2), (3, 1, 4))
    ]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(make_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    accumulator = GradientAccumulator(model, gradient_accumulation_steps=3, data_parallel_group=mesh["dp"].get_group())
    for x, y in data[mesh.get_local_rank("dp")]:
        accumulator.backward(nn.functional.cross_entropy(model(x), y), num_items=len(y))
    result = accumulator.step(optimizer)
    weights = full_parameters(model)

    reference = make_model().double()
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    total = sum(len(y) for micros in data for _, y in micros)
    loss = sum(
        nn.functional.cross_entropy(reference(x.double()), y, reduction="sum") for micros in data for x, y in micros
    )
    (loss / total).backward()
    ref = {n: (p - p.grad).detach() for n, p in reference.named_parameters()}
    return {
        "relative_update_error": relative_error(weights, initial, ref),
        "num_items": result.num_items,
        "buffers": type(accumulator.buffers).__name__,
        "window_collectives": accumulator.num_collectives,
    }


def composed_cases(record: dict[str, Any], route: str, out_dir: str) -> None:
    """`COMPOSED_CASES` on `route`, stock and ours, into `record` (`sft/stock`, `lora/ours`, ...)."""
    path = os.path.join(out_dir, "causal_lm")
    rows = dataset("causal_lm", MICRO * STEPS * ROUTES[route]["dp"])
    for case in COMPOSED_CASES.get(route, ()):
        reference = load(path)
        if case == "lora":
            reference = lora(reference)
        if case == "lora" and "tp" in route.split("_"):
            # PEFT initialises a tensor-parallel layer's adapter shard by shard (a `DTensor` `lora_B`), so the
            # reference starts from the sharded model's adapters as they are, gathered whole.
            sharded = full_parameters(lora(load(path, **ROUTES[route]["load"])))
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    p.copy_(sharded[name])
        initial, ref = large_batch_reference(reference, rows)
        for name, cls in (("stock", Trainer), ("ours", GradAccumTrainer)):
            try:
                weights, record[f"{case}/{name}/layout"] = train_once(cls, path, route, rows, out_dir, case=case)
                record[f"{case}/{name}"] = relative_error(weights, initial, ref)
            except Exception as error:  # the test says which trainer may fail, and how
                record[f"{case}/{name}"] = f"{type(error).__name__}: {error}"


def main(out_dir: str, routes: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    lift_accelerate_device_checks()
    save_models(out_dir)
    for route in routes:
        if route in ("tp_bf16", "engine_tp_dp"):
            record = {"route": route, **(bf16_accumulation(out_dir) if route == "tp_bf16" else plain_engine_tp_dp())}
            if dist.get_rank() == 0:
                (Path(out_dir) / f"{route}.json").write_text(json.dumps(record))
            continue
        record: dict[str, Any] = {"route": route, "world_size": dist.get_world_size()}
        for model_name in MODELS:
            path = os.path.join(out_dir, model_name)
            rows = dataset(model_name, MICRO * STEPS * ROUTES[route]["dp"])
            initial, ref = large_batch_reference(path, rows)
            trainers: list[tuple[str, type, dict]] = [("stock", Trainer, {}), ("ours", GradAccumTrainer, {})]
            if route in FSDP_ROUTES:
                once = dict(fsdp_reduce_schedule="once_per_window")
                trainers.append(("ours_once_per_window", GradAccumTrainer, once))
            for name, cls, overrides in trainers:
                try:
                    weights, record[f"{model_name}/{name}/layout"] = train_once(
                        cls, path, route, rows, out_dir, **overrides
                    )
                    record[f"{model_name}/{name}"] = relative_error(weights, initial, ref)
                except Exception as error:  # the test says which trainer may fail, and how
                    record[f"{model_name}/{name}"] = f"{type(error).__name__}: {error}"
        composed_cases(record, route, out_dir)
        record["refused"] = refusals(route, out_dir)
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, f"{route}.json"), "w") as f:
                json.dump(record, f)
            print(json.dumps(record), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
