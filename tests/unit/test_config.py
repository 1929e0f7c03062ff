"""``CheckpointConfig`` takes torchtitan's names for the options that mean the same, in
Python and in YAML, and refuses one option given two ways with two values."""

from __future__ import annotations

import dataclasses

import pytest

from cnr_train import config_file
from cnr_train.config import JobConfig
from tests import REPO
from torchrec_cnr import CheckpointConfig

ROOT = "/ckpt/run1"


@pytest.mark.parametrize(
    "titan, ours",
    [
        ({"interval": 500}, {"interval_steps": 500}),
        ({"keep_latest_k": 3}, {"keep_last": 3}),
        ({"keep_latest_k": 0}, {"keep_last": None}),
        ({"load_step": 200}, {"restore_step": 200}),
        ({"load_step": -1}, {"restore_step": None}),
        ({"async_mode": "disabled"}, {"wait_for_commit": True}),
        ({"async_mode": "async"}, {"background": "thread", "wait_for_commit": False}),
        ({"async_mode": "async_with_pinned_mem"}, {"background": "process"}),
        ({"exclude_from_loading": ["reader"]}, {"exclude_from_loading": ("reader",)}),
    ],
)
def test_torchtitans_names_set_the_options_they_mean(titan: dict, ours: dict) -> None:
    config = CheckpointConfig(path=ROOT, **titan)
    assert config == CheckpointConfig(path=ROOT, **ours)
    for name, value in ours.items():
        assert getattr(config, name) == value
    # They set fields, so a copy keeps them; the names themselves are not fields.
    assert dataclasses.replace(config, policy="full").policy == "full"
    assert dataclasses.replace(config) == config


@pytest.mark.parametrize(
    "both, needle",
    [
        ({"interval": 500, "interval_steps": 100}, "interval .* and interval_steps are both set"),
        ({"keep_latest_k": 2, "keep_last": 5}, "keep_latest_k .* and keep_last"),
        ({"async_mode": "async", "background": "process"}, "async_mode .* and background"),
        ({"keep_latest_k": -1}, "keep_latest_k must be an int >= 0"),
        ({"load_step": -2}, "load_step must be -1"),
        ({"async_mode": "sometimes"}, "async_mode must be one of"),
        ({"exclude_from_loading": "reader"}, "exclude_from_loading must be a list"),
        ({"restore_step": -1}, "restore_step must be an int >= 0"),
    ],
)
def test_an_option_given_two_ways_or_out_of_range_is_refused_naming_it(
    both: dict, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        CheckpointConfig(path=ROOT, **both)


def test_the_same_option_given_both_ways_with_one_value_is_taken() -> None:
    assert CheckpointConfig(path=ROOT, interval=20, interval_steps=20).interval_steps == 20


def test_a_yaml_checkpoint_section_in_torchtitans_names_builds_the_same_config() -> None:
    titan = ["checkpoint.interval_steps=null", "checkpoint.interval=20",
             "checkpoint.keep_latest_k=2", "checkpoint.load_step=-1",
             "checkpoint.async_mode=disabled", "checkpoint.exclude_from_loading=[reader]"]  # fmt: skip
    ours = ["checkpoint.interval_steps=20", "checkpoint.keep_last=2",
            "checkpoint.wait_for_commit=true", "checkpoint.exclude_from_loading=[reader]"]  # fmt: skip
    demo = REPO / "configs" / "demo.yaml"
    assert config_file.load(JobConfig, demo, titan) == config_file.load(JobConfig, demo, ours)
