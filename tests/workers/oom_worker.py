"""Train under a real address-space limit (RLIMIT_AS): the CPU allocator fails for large micro-batches, and
GradAccumTrainer(auto_find_batch_size=True) must shrink the micro-batch and keep the effective batch.

    python -m tests.workers.oom_worker --micro 32 --steps 2 --limit_mb 200 --out result.json
"""

import argparse
import json
import re
import resource

import datasets
import torch
from torch import nn

from hf_gradaccum import GradAccumArguments, GradAccumTrainer

DIM = 1024


class OuterProductNet(nn.Module):
    """Each sample makes a DIM x DIM activation (4 MiB in fp32): memory grows fast with the micro-batch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x, labels=None):
        h = self.proj(x)
        z = torch.tanh(h[:, :, None] * h[:, None, :]).mean(dim=2)
        logits = self.head(z)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--limit_mb", type=int, default=0, help="address-space headroom above the current size")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = datasets.Dataset.from_dict(
        {
            "x": (torch.randn(args.samples, DIM, generator=g) * 0.1).tolist(),
            "labels": torch.randint(0, 4, (args.samples,), generator=g).tolist(),
        }
    )
    model = OuterProductNet()
    w0 = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    training_args = GradAccumArguments(
        output_dir=args.out + ".run",
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.steps,
        auto_find_batch_size=True,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GradAccumTrainer(model=model, args=training_args, train_dataset=data)
    model(torch.zeros(2, DIM), torch.zeros(2, dtype=torch.long))["loss"].backward()  # warm up threads/allocator
    model.zero_grad(set_to_none=True)
    if args.limit_mb:
        vm_kib = int(re.search(r"VmSize:\s+(\d+)", open("/proc/self/status").read()).group(1))
        limit = vm_kib * 1024 + args.limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    trainer.train()
    if args.limit_mb:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    plan = getattr(trainer, "accumulation_plan", None)
    with open(args.out, "w") as f:
        json.dump(
            {
                "global_step": trainer.state.global_step,
                "micro_batch_chunk_size": trainer.micro_batch_chunk_size,
                "plan": None if plan is None else [plan.micro_batch_size, plan.gradient_accumulation_steps],
                "update": (w - w0).tolist(),
            },
            f,
        )


if __name__ == "__main__":
    main()
