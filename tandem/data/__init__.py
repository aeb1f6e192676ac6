"""Datasets, prompt formatting and the group sampler."""

from tandem.data.datasets import DataError, check_prompt, load_prompt_dataset, sample_rows, validate_rows
from tandem.data.prompts import PROMPT_TRUNCATION, encode_prompt, prompt_text
from tandem.data.sampler import GroupSampler, SamplerState

__all__ = [
    "PROMPT_TRUNCATION",
    "DataError",
    "GroupSampler",
    "SamplerState",
    "check_prompt",
    "encode_prompt",
    "load_prompt_dataset",
    "prompt_text",
    "sample_rows",
    "validate_rows",
]
