"""Worker for `tests/test_subclass_overrides.py`, run on 2 gloo processes by `accelerate launch`: a user's
`training_step` override on a tiny Llama under DDP, GA 2.

- `mutate`: the override calls `super()` once and then multiplies every `.grad` by 1000 in the middle of a window (on
  the stock Trainer that would change the step). Each rank records its micro-batches; rank 0 rebuilds every window
  from both ranks' and checks the update against one SGD(lr=1) step per window on the window as one batch.
- `bypass`: the override copies the older hand-divided body (never calling `super()`): under several processes it must
  stop before the first optimizer step, with the weights unchanged.
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.composition_cases import (  # noqa: E402
    TRAIN_ARGS,
    causal_lm_window_loss,
    flat_trainable,
    reference_copy,
    sgd_reference,
    text_dataset,
    tiny_llama,
    update_error,
    word_tokenizer,
)


class Recording(GradAccumTrainer):
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.windows_seen.append([{k: v.detach().cpu() for k, v in b.items()} for b in batches])
        return batches, items


class MutatesMidWindow(Recording):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1000.0)
                    self.mutated += 1
        return loss


class OlderShape(Recording):
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs)
        if self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()


def _rows(tokenizer, n: int) -> list[dict]:
    texts = list(text_dataset(n)["text"])
    return [{"input_ids": ids, "labels": ids} for ids in tokenizer(texts)["input_ids"]]


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main(mode: str, output_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    args = GradAccumArguments(
        output_dir, **{**TRAIN_ARGS, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    )
    cls = MutatesMidWindow if mode == "mutate" else OlderShape
    rows = _rows(word_tokenizer(), 16)
    trainer = cls(model=tiny_llama(), args=args, train_dataset=rows, data_collator=_collate)
    trainer.windows_seen, trainer.mutated = [], 0
    initial, start = flat_trainable(trainer.model), reference_copy(trainer.model)
    if mode == "bypass":
        try:
            trainer.train()
        except RuntimeError as stop:
            assert "under several processes" in str(stop), stop
            assert torch.equal(flat_trainable(trainer.model), initial)
            if dist.get_rank() == 0:
                print(f"stopped: {str(stop)[:200]}")
            return
        raise AssertionError("a bypass under DDP trained instead of stopping")
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    assert trainer.mutated > 0  # the override found gradients mid-window, and changed them
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer.windows_seen)
    if dist.get_rank() == 0:
        windows = [sum((rank[w] for rank in gathered), []) for w in range(len(gathered[0]))]
        err = update_error(initial, trainer.model, sgd_reference(start, windows, causal_lm_window_loss))
        print(f"DDP x2, a training_step override changing .grad mid-window: relative update error {err:.2e}")
        assert err <= 1e-5, err


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
