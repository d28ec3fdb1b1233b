"""The pieces of the DeepSpeed support that need no DeepSpeed engine: the fp32 accumulation and reduction dtypes
written into (or refused in) a DeepSpeed configuration, and `hf-gradaccum env` naming the installed engines. The
engine itself is tested in tests/test_deepspeed.py (marker `deepspeed`)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from hf_gradaccum.diagnostics.environment import collect_environment, format_environment
from hf_gradaccum.distributed.deepspeed import accumulate_in_fp32


def test_fp32_accumulation_and_reduction_are_set_when_unset():
    config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "auto"}}
    accumulate_in_fp32(config)
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["communication_data_type"] == "fp32"


def test_fp32_accumulation_kept_when_the_config_says_fp32():
    config = {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
    accumulate_in_fp32(config)
    assert config == {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "bfloat16"])
def test_lower_accumulation_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"data_types.grad_accum_dtype: " + dtype + r".*Set it to 'fp32'"):
        accumulate_in_fp32({"data_types": {"grad_accum_dtype": dtype}})


def test_lower_communication_dtype_is_kept_with_a_warning(caplog):
    config = {"communication_data_type": "bf16"}
    with caplog.at_level(logging.WARNING, logger="hf_gradaccum.distributed.deepspeed"):
        accumulate_in_fp32(config)
    assert config["communication_data_type"] == "bf16"
    assert "communication_data_type: bf16" in caplog.text


def test_env_names_the_installed_engines():
    env = collect_environment()
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = None
    assert env["engines"]["DeepSpeed"] == deepspeed
    assert env["engines"]["DDP"] and env["engines"]["FSDP2"]
    line = next(line for line in format_environment(env).splitlines() if line.startswith("- Engines:"))
    assert ("DeepSpeed " + deepspeed if deepspeed else "DeepSpeed not installed") in line, line
