"""TRL's and transformers' argument classes with the accumulation options, composed the one documented way
(`@dataclass class MyConfig(GradAccumFields, SFTConfig)`). Module-level so that the Trainer can pickle the arguments
into its checkpoints; importing this module imports `trl`."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainingArguments
from trl import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, SFTConfig

from hf_gradaccum import GradAccumFields


@dataclass
class GradAccumSFTConfig(GradAccumFields, SFTConfig):
    pass


@dataclass
class GradAccumDPOConfig(GradAccumFields, DPOConfig):
    pass


@dataclass
class GradAccumRewardConfig(GradAccumFields, RewardConfig):
    pass


@dataclass
class GradAccumSeq2SeqArguments(GradAccumFields, Seq2SeqTrainingArguments):
    pass


@dataclass
class GradAccumKTOConfig(GradAccumFields, KTOConfig):
    pass


@dataclass
class GradAccumGRPOConfig(GradAccumFields, GRPOConfig):
    pass
