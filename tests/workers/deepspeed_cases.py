"""Worker for `tests/test_deepspeed.py`, run on 2 gloo processes by `accelerate launch` (`DS_ACCELERATOR=cpu`): real
DeepSpeed ZeRO engines under the stock `Trainer` and `GradAccumTrainer`, several configurations in sequence in one
launch (each launch costs the start-up of two processes and DeepSpeed). Rank 0 writes one JSON record per case.

Cases (the first argument after the output file):
- `parity`: BERT sequence classification and a GPT-2 causal LM (uneven padding) under ZeRO 1, 2 and 3 (and ZeRO-3
  with optimizer and parameter offload), GA 4 x micro-batch 2 x 2 ranks = the 16 samples, one SGD(lr=1) step, against
  one step on the 16 samples as one batch; the stock Trainer's error recorded next to ours. Then `(GradAccumTrainer,
  SFTTrainer)` with a LoRA model under ZeRO-2; resume from DeepSpeed's checkpoint under ZeRO-2 and ZeRO-3 against an
  uninterrupted run; and every refusal, each a trainer constructed and its error recorded.
- `accelerate`: the DeepSpeed plugin comes from the Accelerate config the launch was given (`distributed_type:
  DEEPSPEED`), not from the arguments; BERT and GPT-2, stock and ours.

Usage: accelerate launch --config_file CONFIG tests/workers/deepspeed_cases.py OUT_JSON {parity,accelerate} DIR
"""

import copy
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer, TrainingArguments, default_data_collator  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.composition_cases import TRAIN_ARGS  # noqa: E402
from tests.parity_cases import CASES, causal_lm_data, seq_cls_data  # noqa: E402

SAMPLES, MICRO, STEPS = 16, 2, 4  # x 2 ranks: one window of the 16 samples


def ds_config(stage: int, offload: bool = False, **extra) -> dict:
    """A DeepSpeed config whose batch sizes, clipping and precision the Trainer fills in ("auto")."""
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # The Trainer's own torch optimizer (SGD, AdamW) goes to DeepSpeed as a client optimizer.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **extra,
    }


def train_args(cls, output_dir: str, ds, **overrides):
    """The parity tests' arguments (SGD lr=1, no clipping, sequential order), GA 4 x micro-batch 2, DeepSpeed `ds`."""
    kwargs = {**TRAIN_ARGS, "per_device_train_batch_size": MICRO, "gradient_accumulation_steps": STEPS}
    if ds is not None:
        kwargs["deepspeed"] = ds
    kwargs.update(overrides)
    return cls(output_dir, **kwargs)


def models_and_data() -> dict:
    """The models (built once, before any DeepSpeed config exists, so none is built under ZeRO-3's `zero.Init`) and
    their 16 samples."""
    cases = {case.name: case for case in CASES}
    torch.manual_seed(0)
    bert = cases["bert_seq_cls"].make_model()
    gpt2 = cases["gpt2_causal_lm"].make_model()
    gpt2.loss_type = "ForCausalLM"  # unset, transformers counts a GPT-2's labels unshifted
    return {
        "bert": (bert, seq_cls_data(SAMPLES, torch.Generator().manual_seed(1))),
        "gpt2": (gpt2, causal_lm_data(SAMPLES, torch.Generator().manual_seed(2))),
    }


def full_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters, gathered from their ZeRO-3 partitions where partitioned (a collective on every rank)."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().flatten().double().cpu() for p in params])


def partition_numel(engine) -> dict:
    """Elements of the model (`total`), of its parameters this rank holds (`parameters`: a partition under ZeRO-3) and
    of the fp32 master copy this rank's optimizer updates (`fp32_master`: a partition under ZeRO 1/2/3; the gradients
    reduced for it are the same size from ZeRO-2 on), counted from the engine's own tensors."""
    params = list(engine.module.parameters())
    fp32 = None
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        groups = getattr(engine.optimizer, name, None)
        if groups:
            fp32 = sum(g.numel() for g in groups)
            break
    return {
        "total": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "parameters": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
        "fp32_master": fp32,
    }


def large_batch_steps(model: torch.nn.Module, data, max_grad_norm: float = 0.0) -> torch.Tensor:
    """One SGD(lr=1) step per window, each on the window's samples as one batch, in fp64, its gradient clipped to
    `max_grad_norm` when > 0: the update to match. A window is 16 consecutive samples (GA 4 x micro-batch 2 x 2 ranks);
    the last one may be shorter (the end of an epoch)."""
    model = copy.deepcopy(model).double().train()
    window = MICRO * STEPS * 2
    for start in range(0, len(data), window):
        batch = default_data_collator([data[i] for i in range(start, min(start + window, len(data)))])
        model.zero_grad()
        model(**batch).loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def reset_accelerate() -> None:
    """Let the next Trainer build its Accelerator from its own DeepSpeed plugin (the process group stays)."""
    AcceleratorState._reset_state()


def shipped_config(stage: int, offload: bool = False) -> str:
    """The path of the configs/deepspeed file for `stage` (the `TrainingArguments(deepspeed="file.json")` route)."""
    return f"configs/deepspeed/zero{stage}{'_offload' if offload else ''}.json"


def parity_case(
    name, stage, trainer_cls, args_cls, model, data, workdir, ds=True, offload=False, scale_wrt_gas=False, **overrides
) -> dict:
    """Train one epoch under DeepSpeed and compare the update with `large_batch_steps`. `scale_wrt_gas=True`: the
    Trainer's `scale_wrt_gas=False` is dropped on its way to DeepSpeed, which then divides each loss by its
    accumulation steps itself (what a caller other than the Trainer gets)."""
    reset_accelerate()
    start = time.time()
    config = shipped_config(stage, offload) if ds else None
    args = train_args(args_cls, f"{workdir}/{name}", config, **overrides)
    initial = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    trainer = trainer_cls(model=copy.deepcopy(model), args=args, train_dataset=data)
    assert trainer.is_deepspeed_enabled
    if scale_wrt_gas:
        backward = trainer.accelerator.backward
        trainer.accelerator.backward = lambda loss, scale_wrt_gas=None, **kwargs: backward(loss, **kwargs)
    trainer.train()
    after = full_params(trainer.model)
    reference = large_batch_steps(model, data, args.max_grad_norm)
    error = float(((after - initial) - (reference - initial)).norm() / (reference - initial).norm())
    engine = trainer.model_wrapped
    config = engine.config
    return {
        "precision": "bf16" if overrides.get("bf16") else "fp32",
        "grad_accum_dtype": config.get("data_types", {}).get("grad_accum_dtype"),
        "partition_numel": partition_numel(engine),
        "case": name,
        "stage": engine.zero_optimization_stage(),
        "offload": bool(engine.zero_cpu_offload()),
        "engine": type(engine).__name__,
        "trainer": trainer_cls.__name__,
        "error": error,
        "clipped_norm": args.max_grad_norm,
        "optimizer_steps": trainer.state.global_step,
        "seconds": round(time.time() - start, 1),
    }


def sft_lora_case(workdir: str) -> dict:
    """`(GradAccumTrainer, SFTTrainer)` + LoRA under ZeRO-2: each rank records its micro-batches; rank 0 rebuilds the
    window from both ranks' and checks one SGD(lr=1) step on it as one batch."""
    from peft import LoraConfig

    from tests.composed_arguments import GradAccumSFTConfig
    from tests.composition_cases import (
        causal_lm_window_loss,
        flat_trainable,
        reference_copy,
        sgd_reference,
        text_dataset,
        tiny_llama,
        update_error,
        word_tokenizer,
    )
    from tests.workers.composition_ddp import RecordingSFT

    reset_accelerate()
    torch.manual_seed(0)
    args = train_args(GradAccumSFTConfig, f"{workdir}/sft", ds_config(2), bf16=False)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    trainer = RecordingSFT(
        model=tiny_llama(),
        args=args,
        train_dataset=text_dataset(SAMPLES),
        processing_class=word_tokenizer(),
        peft_config=lora,
    )
    trainer.windows_seen = []
    initial, start = flat_trainable(trainer.model), reference_copy(trainer.model)
    trainer.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer.windows_seen)
    windows = [sum((rank[w] for rank in gathered), []) for w in range(len(gathered[0]))]
    error = update_error(initial, trainer.model, sgd_reference(start, windows, causal_lm_window_loss))
    return {"case": "sft_lora_zero2", "stage": 2, "trainer": "GradAccumTrainer+SFTTrainer+LoRA", "error": error}


def resume_case(stage: int, model, data, workdir: str) -> dict:
    """Two windows with AdamW (its state matters): uninterrupted, saving DeepSpeed's checkpoint after window 1; then a
    fresh trainer resumed from that checkpoint. The final weights must agree."""
    ckpt_args = dict(optim="adamw_torch", learning_rate=1e-2, max_steps=2, save_strategy="steps", save_steps=1)
    finals = []
    for resume in (None, f"{workdir}/resume{stage}/checkpoint-1"):
        reset_accelerate()
        args = train_args(GradAccumArguments, f"{workdir}/resume{stage}", ds_config(stage), **ckpt_args)
        if resume is not None:
            args.output_dir = f"{workdir}/resume{stage}_b"
        trainer = GradAccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        finals.append(full_params(trainer.model))
    uninterrupted, resumed = finals
    error = float((resumed - uninterrupted).norm() / uninterrupted.norm())
    steps_differ = float((uninterrupted - full_params(model)).norm())
    return {"case": f"resume_zero{stage}", "stage": stage, "error": error, "update_norm": steps_differ}


REFUSALS = {
    "auto_find_batch_size": dict(auto_find_batch_size=True),
    "verify_accumulation": dict(verify_accumulation="first_step"),
    "offload_accumulation_buffer": dict(offload_accumulation_buffer=True),
    "moe_load_balance": dict(moe_load_balance="window"),
    "take_back_skipped_steps": dict(take_back_skipped_steps=True),
    "fp16_recompute": dict(fp16=True),
}


def refusal_cases(model, data, workdir: str) -> list[dict]:
    """Each option that cannot run under DeepSpeed: a trainer constructed with it, and the error it raised."""
    from hf_gradaccum import ranking_coupled_loss
    from tests.composition_cases import tiny_mixtral

    out = []
    for name, overrides in [*REFUSALS.items(), ("coupled_loss", {}), ("autotp", {})]:
        reset_accelerate()
        config = ds_config(2, tensor_parallel={"autotp_size": 2}) if name == "autotp" else ds_config(2)
        args = train_args(GradAccumArguments, f"{workdir}/refuse_{name}", config, **overrides)
        kwargs = {"coupled_loss": ranking_coupled_loss()} if name == "coupled_loss" else {}
        try:
            refused_model = tiny_mixtral() if name == "moe_load_balance" else copy.deepcopy(model)
            GradAccumTrainer(model=refused_model, args=args, train_dataset=data, **kwargs)
            out.append({"case": f"refuse_{name}", "refused": False, "message": ""})
        except ValueError as err:
            out.append({"case": f"refuse_{name}", "refused": True, "message": str(err)})
    # bf16: DeepSpeed is told to accumulate and reduce in fp32.
    reset_accelerate()
    args = train_args(GradAccumArguments, f"{workdir}/bf16", ds_config(2), bf16=True)
    trainer = GradAccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=data)
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    out.append(
        {"case": "bf16_dtypes", "data_types": config.get("data_types"), "comm": config.get("communication_data_type")}
    )
    return out


def main(out_json: str, mode: str, workdir: str) -> None:
    warnings.filterwarnings("ignore")
    records = []
    cases = models_and_data()
    if mode == "parity":
        for stage in (1, 2, 3):
            for model_name, (model, data) in cases.items():
                for trainer_cls, args_cls in ((Trainer, TrainingArguments), (GradAccumTrainer, GradAccumArguments)):
                    name = f"zero{stage}_{model_name}_{trainer_cls.__name__}"
                    records.append(parity_case(name, stage, trainer_cls, args_cls, model, data, workdir))
            # The engine without accumulation: the stock Trainer at GA 1, the window as one micro-batch of 8 per rank.
            model, data = cases["bert"]
            name, one_pass = f"zero{stage}_bert_Trainer_ga1", {"per_device_train_batch_size": 8}
            records.append(
                parity_case(
                    name,
                    stage,
                    Trainer,
                    TrainingArguments,
                    model,
                    data,
                    workdir,
                    gradient_accumulation_steps=1,
                    **one_pass,
                )
            )
        model, data = cases["gpt2"]
        partial = data.select(list(range(SAMPLES)) + list(range(SAMPLES // 2)))  # windows of 16 and 8 samples
        for stage in (2, 3):
            for trainer_cls, args_cls in ((Trainer, TrainingArguments), (GradAccumTrainer, GradAccumArguments)):
                name = f"zero{stage}_partial_gpt2_{trainer_cls.__name__}"
                records.append(parity_case(name, stage, trainer_cls, args_cls, model, partial, workdir))
        for stage in (2, 3):
            name = f"zero{stage}_clip_gpt2_GradAccumTrainer"  # DeepSpeed clips the window's summed gradient
            records.append(
                parity_case(name, stage, GradAccumTrainer, GradAccumArguments, model, data, workdir, max_grad_norm=0.5)
            )
        bert, bert_data = cases["bert"]
        for stage in (1, 3):
            name = f"zero{stage}_scale_wrt_gas_bert_GradAccumTrainer"
            records.append(
                parity_case(
                    name, stage, GradAccumTrainer, GradAccumArguments, bert, bert_data, workdir, scale_wrt_gas=True
                )
            )
        for stage in (1, 2, 3):
            name = f"zero{stage}_bf16_gpt2_GradAccumTrainer"
            model, data = cases["gpt2"]
            records.append(
                parity_case(name, stage, GradAccumTrainer, GradAccumArguments, model, data, workdir, bf16=True)
            )
        for model_name, (model, data) in cases.items():
            name = f"zero3_offload_{model_name}_GradAccumTrainer"
            records.append(
                parity_case(name, 3, GradAccumTrainer, GradAccumArguments, model, data, workdir, offload=True)
            )
        records.append(sft_lora_case(workdir))
        gpt2, gpt2_data = cases["gpt2"]
        double = gpt2_data.select(list(range(SAMPLES)) * 2)  # two windows
        for stage in (2, 3):
            records.append(resume_case(stage, gpt2, double, workdir))
        records.extend(refusal_cases(*cases["bert"], workdir))
    elif mode == "quick":
        model, data = cases["bert"]
        for trainer_cls, args_cls in ((Trainer, TrainingArguments), (GradAccumTrainer, GradAccumArguments)):
            records.append(parity_case(f"q_{trainer_cls.__name__}", 2, trainer_cls, args_cls, model, data, workdir))
    elif mode == "accelerate":
        for model_name, (model, data) in cases.items():
            for trainer_cls, args_cls in ((Trainer, TrainingArguments), (GradAccumTrainer, GradAccumArguments)):
                name = f"accelerate_{model_name}_{trainer_cls.__name__}"
                records.append(parity_case(name, None, trainer_cls, args_cls, model, data, workdir, ds=False))
    else:
        raise ValueError(f"mode must be 'parity' or 'accelerate', got {mode!r}")
    if dist.get_rank() == 0:
        for record in records:
            print(json.dumps(record))
        Path(out_json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
