"""The run's batch (`effective_batch_size`) on real gloo processes, for `tests/test_run_batch_distributed.py` and
`benchmarks/bench_run_batch.py`.

One run: a tiny BERT token classifier (ragged labels, so micro-batches hold different item counts), 38 rows, an
effective batch of 10 (windows 10, 10, 10, 8), AdamW with a linear schedule and warmup, clipping at 0.5. The reference
is the stock `Trainer`'s one-process run of the same batch (`per_device_train_batch_size=10`); every layout of ours
must end at its weights.

Usage (each rank runs the same jobs in sequence, rank 0 writes the final weights and a JSON record per job):
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml --num_processes 3 \
        tests/workers/run_batch_cases.py OUT_DIR JOB [JOB ...]
where JOB is `ours:ORDER:MICRO[:resume=CHECKPOINT][:save][:engine=ENGINE]` or `stock:ORDER:MICRO:STEPS`
(ORDER `sequential` or `random`; ENGINE `fsdp2` or `zero2`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from tests.parity_cases import CASES  # noqa: E402

CASE = {c.name: c for c in CASES}["bert_token_cls"]
ROWS = 38
BATCH = 10
SAVE_STEPS = 2


def initial_model_and_data():
    """The run's initial weights and data, the same in every process."""
    torch.manual_seed(0)
    model = CASE.make_model()
    return model, CASE.make_data(ROWS, torch.Generator().manual_seed(1))


def run_settings(output_dir: str, order: str, **overrides) -> dict:
    settings = dict(
        output_dir=output_dir,
        learning_rate=1e-2,
        optim="adamw_torch",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=0.5,
        num_train_epochs=1,
        train_sampling_strategy=order,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return {**settings, **overrides}


def stock_run(output_dir: str, order: str, micro: int = BATCH, steps: int = 1, **overrides) -> Trainer:
    """The stock `Trainer` with `micro x steps` per process (the reference: one process, micro-batch 10)."""
    model, data = initial_model_and_data()
    args = TrainingArguments(
        **run_settings(
            output_dir, order, per_device_train_batch_size=micro, gradient_accumulation_steps=steps, **overrides
        )
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


class StepCounter(TrainerCallback):
    """Optimizer steps taken in this process (a resumed run takes only the rest)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def our_run(
    output_dir: str,
    order: str,
    micro: int,
    resume: str | None = None,
    save: bool = False,
    engine: str | None = None,
    **overrides,
) -> GradAccumTrainer:
    """`GradAccumTrainer` with `effective_batch_size=10` and micro-batches of at most `micro` on this launch's
    processes; `save`: a checkpoint every 2 steps; `resume`: continue from that checkpoint."""
    model, data = initial_model_and_data()
    extra = {"save_strategy": "steps", "save_steps": SAVE_STEPS, **overrides} if save else dict(overrides)
    if engine == "zero2":
        extra["deepspeed"] = "configs/deepspeed/zero2.json"
    args = GradAccumArguments(
        **run_settings(output_dir, order, per_device_train_batch_size=micro, effective_batch_size=BATCH, **extra)
    )
    if engine == "fsdp2":
        from tests.workers.ddp_workers import use_accelerate_fsdp_on_cpu

        _ = args.device
        use_accelerate_fsdp_on_cpu(2)
    trainer = GradAccumTrainer(model=model, args=args, train_dataset=data, callbacks=[StepCounter()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained weights, unsharded (FSDP2) and gathered (DeepSpeed ZeRO), on every rank."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped) if trainer.is_deepspeed_enabled else None
    if state is None:
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k.removeprefix("module."): v.detach().clone().double() for k, v in state.items()}


def run_job(out_dir: str, job: str) -> None:
    kind, order, micro, *options = job.split(":")
    name = "_".join([kind, order, micro, *(o.split("=")[0] for o in options)])
    output_dir = os.path.join(out_dir, f"{name}_w{int(os.environ.get('WORLD_SIZE', '1'))}")
    if kind == "stock":
        trainer = stock_run(output_dir, order, int(micro), int(options[0]))
        record = {"gradient_accumulation_steps": int(options[0])}
    else:
        opts = dict(o.split("=", 1) if "=" in o else (o, True) for o in options)
        trainer = our_run(
            output_dir, order, int(micro), opts.get("resume"), bool(opts.get("save")), opts.get("engine")
        )
        layout = trainer._run_batch.layout()
        record = {
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "layout": layout.describe(BATCH),
            "last_window": layout.describe(ROWS % BATCH),
            "engine": "fsdp" if trainer.is_fsdp_enabled else "deepspeed" if trainer.is_deepspeed_enabled else "ddp",
            "steps_run": next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepCounter)).steps,
        }
    state = full_state(trainer)
    if trainer.args.process_index == 0:
        record.update(job=job, world_size=trainer.args.world_size, global_step=trainer.state.global_step)
        torch.save(state, os.path.join(out_dir, f"{name}_w{trainer.args.world_size}.pt"))
        with open(os.path.join(out_dir, f"{name}_w{trainer.args.world_size}.json"), "w") as f:
            json.dump(record, f)


def relative_error(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], initial) -> float:
    """`||w - w_ref|| / ||w_ref - w_0||` over all weights: the error relative to the run's update."""
    w0 = {k: v.detach().double() for k, v in initial.state_dict().items()}
    diff = sum(float((state[k] - reference[k]).pow(2).sum()) for k in reference)
    update = sum(float((reference[k] - w0[k]).pow(2).sum()) for k in reference)
    return (diff / update) ** 0.5


def main(out_dir: str, *jobs: str) -> None:
    for job in jobs:
        run_job(out_dir, job)


if __name__ == "__main__":
    from hf_gradaccum.engine.process_exit import leave_process_group_and_exit

    main(*sys.argv[1:])
    leave_process_group_and_exit(0)
