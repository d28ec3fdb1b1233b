"""A small GradAccumTrainer run that can SIGKILL itself at a chosen point, then be resumed.

python -m tests.workers.kill_worker OUTPUT_DIR --kill_at save:3     # killed while checkpoint-3 is being written
python -m tests.workers.kill_worker OUTPUT_DIR --resume             # resume from the last complete checkpoint
"""

import argparse
import os
import signal

import torch
from transformers import TrainerCallback

from hf_gradaccum import GradAccumArguments, GradAccumTrainer
from tests.parity_cases import CASES

CASE = {c.name: c for c in CASES}["bert_seq_cls"]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtMicroStep(TrainerCallback):
    """Kills the process in the middle of window `step + 1` (after its first micro-batch)."""

    def __init__(self, step: int):
        self.step = step

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            die()


def kill_during_save(step: int) -> None:
    """Kill while checkpoint-`step` is half-written: the model file is there, the optimizer file is not."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, str) and f.endswith("optimizer.pt") and f"checkpoint-{step}" in f:
            die()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--kill_at", default=None, help="save:N | window:N")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = CASE.make_model()
    data = CASE.make_data(64, torch.Generator().manual_seed(7))  # 8 windows of 2 x 4
    training_args = GradAccumArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        num_train_epochs=1,
        fp16=True,
        loss_scale_init=256.0,
        loss_scale_growth_interval=3,
        train_sampling_strategy="sequential",
        save_strategy="steps",
        save_steps=1,
        atomic_checkpoints=True,  # the crash-while-saving cases need atomic writes (opt-in)
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GradAccumTrainer(model=model, args=training_args, train_dataset=data)
    if args.kill_at:
        kind, step = args.kill_at.split(":")
        if kind == "save":
            kill_during_save(int(step))
        else:
            trainer.add_callback(KillAtMicroStep(int(step)))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    torch.save(
        {
            "weights": [p.detach().clone() for p in trainer.model.parameters()],
            "scaler": trainer.accumulator.loss_scaler.state_dict(),
        },
        os.path.join(args.output_dir, "final.pt"),
    )


if __name__ == "__main__":
    main()
