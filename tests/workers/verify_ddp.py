"""2 gloo ranks, `verify_accumulation="first_step"`: rank 1 counts its items wrongly (rows, for a token-level loss),
rank 0 correctly, so only rank 1's own window fails; both ranks must report the same (failing) verdict."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests.*`

import torch  # noqa: E402
from transformers import BertForTokenClassification  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402
from tests.parity_cases import tiny_bert_config, token_cls_data  # noqa: E402


class RankDependentCounting(GradAccumTrainer):
    def count_micro_batch_items(self, inputs):
        if self.args.process_index == 1:
            return int(inputs["labels"].shape[0])  # rows: wrong for a mean over tokens
        return super().count_micro_batch_items(inputs)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = BertForTokenClassification(tiny_bert_config(num_labels=4))
    args = GradAccumArguments(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        verify_accumulation="first_step",
        # The count is wrong on purpose (on rank 1), for the verification to find: its own check would stop first.
        check_declared_normalisation=False,
    )
    trainer = RankDependentCounting(model=model, args=args, train_dataset=token_cls_data(32, torch.Generator()))
    results = []
    original = trainer.verify_accumulation
    trainer.verify_accumulation = lambda batches: results.append(original(batches)) or results[-1]
    trainer.train()
    result = results[0]
    record = {
        "rank": trainer.args.process_index,
        "passed": result.passed,
        "max_rel_diff": result.max_rel_diff,
        "local_diagnosis": result.diagnosis is not None,
    }
    with open(os.path.join(out_dir, f"verdict_rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group_and_exit(0)  # an exit that cannot abort in gloo's teardown
