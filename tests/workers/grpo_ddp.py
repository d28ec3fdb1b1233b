"""Worker for `tests/test_composition_grpo_ddp.py`, run on 2 gloo processes by `accelerate launch`: a composed
GRPOTrainer (`loss_type` and class order from the command line) trains one window of K = 3 micro-batches of 4
completions per rank under DDP. Every rank then gathers all ranks' generated micro-batches and checks the update
against one SGD(lr=1) step on all of them as one batch, through TRL's own loss on the initial weights: the token mean
over the batch's completion tokens, which is what `bnpo` is on one batch and what `dapo` is on one batch with
`steps_per_generation == gradient_accumulation_steps` (its divisor is the batch's tokens on all ranks). Stock TRL at
GA = 1 under DDP averages the ranks' token means instead for `bnpo`, so it is not the reference here.

With `grpo` (a mean over sequences) and an entropy bonus (a mean over completion tokens), TRL's own loss on the one
batch is the reference as it stands: each term is then a mean over all of the batch's sequences or tokens.

With `top_entropy_quantile < 1` the reference takes the quantile over the one batch's tokens, once each.

Usage: `accelerate launch ... tests/workers/grpo_ddp.py OUTPUT_DIR LOSS_TYPE ORDER [ENTROPY_COEF [QUANTILE]]`.
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.grpo_cases import GRPO_ORDERS, grpo_args, train_grpo  # noqa: E402

KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def _pad(tensors: list[torch.Tensor], left: bool) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    pads = [(width - t.shape[1], 0) if left else (0, width - t.shape[1]) for t in tensors]
    return torch.cat([torch.nn.functional.pad(t, p, value=0) for t, p in zip(tensors, pads, strict=True)])


def one_batch(micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The micro-batches as one batch: prompts left-padded, completions right-padded (as TRL pads them)."""
    return {
        "prompt_ids": _pad([b["prompt_ids"] for b in micro_batches], left=True),
        "prompt_mask": _pad([b["prompt_mask"] for b in micro_batches], left=True),
        "completion_ids": _pad([b["completion_ids"] for b in micro_batches], left=False),
        "completion_mask": _pad([b["completion_mask"] for b in micro_batches], left=False),
        "advantages": torch.cat([b["advantages"] for b in micro_batches]),
    }


def one_process_high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """GRPO's `get_high_entropy_mask` on one process: the quantile of the batch's own completion tokens (every rank
    computes the reference on the whole batch, so TRL's gather would count each token once per rank)."""
    values = entropies[mask.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    return ((entropies * mask.float()) >= torch.quantile(values, threshold)) & mask.bool()


def main(output_dir: str, loss_type: str, order: str, entropy_coef: str = "0", quantile: str = "1") -> None:
    warnings.filterwarnings("ignore")
    args = grpo_args(
        output_dir,
        ga=3,
        batch=4,
        loss_type=loss_type,
        entropy_coef=float(entropy_coef),
        top_entropy_quantile=float(quantile),
    )
    run = train_grpo(GRPO_ORDERS[order], args)
    trainer = run.trainer
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    local = [{k: b[k].detach().cpu() for k in KEYS} for b in trainer._buffered_inputs]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    micro_batches = [b for rank in gathered for b in rank]
    batch = one_batch(micro_batches)
    tokens = [int(b["completion_mask"].sum()) for b in micro_batches]

    # The reference step, outside DDP, on every rank alike (TRL's loss reduces its metrics across ranks): TRL's loss
    # on the whole batch at the initial weights.
    model = trainer.model
    trainer.accumulator.remove_hooks()
    model.load_state_dict(run.initial_state)
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    if loss_type == "dapo":
        trainer.loss_type = "bnpo"  # the token mean over the batch (see the module docstring)
    if float(quantile) < 1:
        trainer.get_high_entropy_mask = one_process_high_entropy_mask
    trainer._compute_loss(model, batch).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    reference = -torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params]
    )
    error = float((run.update - reference).norm() / reference.norm())
    if dist.get_rank() == 0:
        print(
            f"DDP x2 {order} GRPO {loss_type}, entropy_coef {entropy_coef}, top_entropy_quantile {quantile}: "
            "completion tokens per micro-batch "
            f"{tokens}, relative update error {error:.2e}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:6])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
