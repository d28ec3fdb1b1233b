"""Sequential training order on every supported transformers release (the parity references assume it).

transformers 5.x has `TrainingArguments(train_sampling_strategy="sequential")`; 4.x has no such argument and always
samples at random, so there the Trainer's own extension point, `_get_train_sampler`, is overridden instead (what a
4.x user does for a fixed order; `tests/conftest.py` applies it for the test session). Only the order of the samples
changes: the sampler is an input of the tests, not the behaviour under test.
"""

import dataclasses

from torch.utils.data import SequentialSampler
from transformers import TrainingArguments

HAS_SAMPLING_STRATEGY = "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}

# Pass as `**SEQUENTIAL_ORDER` to a TrainingArguments (or subclass) constructor.
SEQUENTIAL_ORDER = {"train_sampling_strategy": "sequential"} if HAS_SAMPLING_STRATEGY else {}


def sequential_train_sampler(trainer, train_dataset=None):
    """`Trainer._get_train_sampler` for releases without `train_sampling_strategy`: the dataset in order."""
    dataset = trainer.train_dataset if train_dataset is None else train_dataset
    return None if dataset is None else SequentialSampler(dataset)
