"""Worker for `tests/test_composition_ddp.py`, run on 2 gloo processes by `accelerate launch`: a composed DPOTrainer
with a loss of two terms (`loss_type=["sigmoid", "sft"]`, RPO: a mean over pairs plus a token mean over the chosen
completions) or a sort (`["aot_unpaired"]`, against another reference model), trains one window of K = 3
micro-batches of 2 pairs per rank under DDP. Every rank gathers all ranks' micro-batches and checks the update
against one SGD(lr=1) step through DPO's own loss on the initial weights.

- RPO: the reference is both ranks' micro-batches as one batch (one process, the paper's batch): each term a mean
  over all of its pairs or tokens. Stock DPO under DDP averages the ranks' token means instead.
- `aot_unpaired`: the reference is each rank's window as one batch, its gradients averaged over the ranks, which is
  what stock DPO at GA = 1 does under DDP (each rank sorts its own batch).

Usage: `accelerate launch ... tests/workers/dpo_terms_ddp.py OUTPUT_DIR LOSS_TYPES ORDER` (`LOSS_TYPES` comma-joined).
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.composition_cases import flat_trainable  # noqa: E402
from tests.trl_zoo_cases import COMMON, preference_dataset, student, tokenizer  # noqa: E402

K, B = 3, 2
KEYS = ("input_ids", "attention_mask", "completion_mask")


def recording(base: type) -> type:
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, items = super(cls, self).get_batch_samples(epoch_iterator, num_batches, device)
        self.window_seen = [{k: b[k].detach().cpu() for k in KEYS} for b in batches]
        return batches, items

    cls = type(f"Recording{base.__name__}", (base,), {"get_batch_samples": get_batch_samples})
    return cls


ORDERS = {
    "gradaccum_first": recording(type("GradAccumFirstDPO", (GradAccumTrainer, DPOTrainer), {})),
    "dpo_first": recording(type("DPOFirstGradAccum", (DPOTrainer, GradAccumTrainer), {})),
}


def one_batch(micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Micro-batches of [chosen; rejected] rows as one batch of that layout, right-padded with zeros."""
    width = max(b["input_ids"].shape[1] for b in micro_batches)

    def half(key: str, second: bool) -> list[torch.Tensor]:
        parts = []
        for b in micro_batches:
            rows = b[key].shape[0] // 2
            part = b[key][rows:] if second else b[key][:rows]
            parts.append(torch.nn.functional.pad(part, (0, width - part.shape[1]), value=0))
        return parts

    return {key: torch.cat(half(key, False) + half(key, True)) for key in KEYS}


def main(output_dir: str, loss_types: str, order: str) -> None:
    warnings.filterwarnings("ignore")
    types = loss_types.split(",")
    # (The windows are rebuilt from what each rank saw, so the sampling order does not matter: transformers < 5 has
    # no `train_sampling_strategy`.)
    common = {k: v for k, v in COMMON.items() if k != "train_sampling_strategy"}
    settings = {**common, "per_device_train_batch_size": B, "gradient_accumulation_steps": K}
    args = DPOConfig(output_dir, loss_type=types, **settings)
    sorted_loss = "aot_unpaired" in types
    reference_model = student(seed=1 if sorted_loss else 0)
    if sorted_loss:
        # As the zoo's "another reference" cases: ranks that are not the completions' lengths alone.
        with torch.no_grad():
            reference_model.lm_head.weight.mul_(30.0)
    trainer = ORDERS[order](
        model=student(),
        args=args,
        train_dataset=preference_dataset(n=2 * B * K, same_length=sorted_loss),
        processing_class=tokenizer(),
        ref_model=reference_model,
    )
    initial_state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    initial = flat_trainable(trainer.model)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    update = flat_trainable(trainer.model) - initial
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer.window_seen)

    # The reference step, outside DDP, on every rank alike (DPO's loss gathers its metrics across ranks).
    model = trainer.model
    trainer.accumulator.remove_hooks()
    model.load_state_dict(initial_state)
    params = [p for p in model.parameters() if p.requires_grad]
    windows = [sum(gathered, [])] if "sft" in types else gathered  # one batch, or each rank's window
    grads = []
    for window in windows:
        model.zero_grad()
        trainer._compute_loss(model, one_batch(window), return_outputs=False).backward()
        grads.append(
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params])
        )
    reference = -sum(grads) / len(grads)
    error = float((update - reference).norm() / reference.norm())
    if dist.get_rank() == 0:
        print(f"DDP x2 {order} DPO {types}: relative update error {error:.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
