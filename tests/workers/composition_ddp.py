"""Worker for `tests/test_composition_ddp.py`, run on 2 gloo processes by `accelerate launch`: a LoRA-wrapped tiny
Llama in `(GradAccumTrainer, SFTTrainer)` under DDP (so the model is DDP(PeftModel(LlamaForCausalLM)) while it
trains). Each rank records the micro-batches it saw; rank 0 rebuilds every window from both ranks' micro-batches and
checks the update against one SGD(lr=1) step per window on the window as one batch."""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import SFTTrainer  # noqa: E402

from hf_gradaccum import GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.composed_arguments import GradAccumSFTConfig  # noqa: E402
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


class RecordingSFT(GradAccumTrainer, SFTTrainer):
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.windows_seen.append([{k: v.detach().cpu() for k, v in b.items()} for b in batches])
        return batches, items


def main(output_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    args = GradAccumSFTConfig(
        output_dir, bf16=False, **{**TRAIN_ARGS, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    )
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    trainer = RecordingSFT(
        model=tiny_llama(),
        args=args,
        train_dataset=text_dataset(22),
        processing_class=word_tokenizer(),
        peft_config=lora,
    )
    trainer.windows_seen = []
    initial, start = flat_trainable(trainer.model), reference_copy(trainer.model)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer.windows_seen)
    if dist.get_rank() == 0:
        windows = [sum((rank[w] for rank in gathered), []) for w in range(len(gathered[0]))]
        err = update_error(initial, trainer.model, sgd_reference(start, windows, causal_lm_window_loss))
        sizes = [[len(b["input_ids"]) for b in w] for w in windows]
        print(f"DDP x2 (GradAccumTrainer, SFTTrainer) + LoRA: windows {sizes}, relative update error {err:.2e}")
        assert err <= 1e-5, err


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
