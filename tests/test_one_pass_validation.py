"""A config's problems are all reported in one run: key names, values, combinations and paths, one paragraph each,
so a user fixes everything at once. Blank keys (`special_tokens:`) are unset, as in Axolotl."""

from __future__ import annotations

import logging

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from tests.helpers import base_config


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    return str(caught.value).split("\n\n")


def test_five_independent_mistakes_are_reported_in_one_run(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    raw = base_config(
        tmp_path,
        learning_rat=1e-4,  # a key-name typo
        micro_batch_size="four",  # a value of the wrong type
        lr_scheduler="cosine_annealing",  # a value outside the allowed set
        save_steps=10,
        saves_per_epoch=2,  # a combination
        output_dir=str(tmp_path / "a-file"),  # a path that cannot be created
    )
    raw["datasets"][0]["typ"] = "chat_template"  # a typo inside a dataset entry
    problems = problems_of(raw)
    expected = [
        "`learning_rat` is not a config key. Did you mean `learning_rate`?",
        "In `datasets[0]`: `typ` is not a config key.",
        "`micro_batch_size`",
        "`lr_scheduler`",
        "`save_steps` and `saves_per_epoch` are both set",
        "is a file; it must be a directory",
    ]
    for needle in expected:
        assert [p for p in problems if needle in p], f"{needle!r} not reported: {problems}"
    assert len(problems) == len(expected), problems


def test_a_problem_that_follows_from_a_wrong_value_is_not_listed_again(tmp_path):
    """`adapter: lorra` is wrong; that the LoRA keys are then 'set without an adapter' is not a second problem."""
    problems = problems_of(base_config(tmp_path, adapter="lorra", lora_r=16))
    assert len(problems) == 1 and "`adapter`" in problems[0], problems


def test_combinations_are_checked_when_a_required_key_is_missing_only_then_not(tmp_path):
    raw = base_config(tmp_path, save_steps=10, saves_per_epoch=2)
    del raw["base_model"]
    problems = problems_of(raw)
    assert len(problems) == 1 and "`base_model` is required but missing" in problems[0]


def test_blank_keys_take_their_defaults(tmp_path):
    blank = validate_config(
        base_config(tmp_path, special_tokens=None, fp16=None, lora_r=None, adapter="lora", optimizer=None)
    )
    plain = validate_config(base_config(tmp_path, adapter="lora"))
    assert blank.model_dump() == plain.model_dump()
    entry_blank = validate_config(
        base_config(tmp_path, datasets=[{"path": "x.jsonl", "type": "chat_template", "split": None}])
    )
    assert entry_blank.datasets[0].split == "train"


def test_a_blank_unknown_key_asks_for_nothing_and_says_what_it_may_have_meant(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        validate_config(base_config(tmp_path, special_tokns=None))
    assert "`special_tokns` is not a config key; left blank, it asks for nothing. Did you mean `special_tokens`?" in (
        caplog.text
    )


def test_a_parameter_of_a_feature_that_is_off_asks_for_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hellbender"):
        validate_config(base_config(tmp_path, eval_max_new_tokens=128))
    assert "`eval_max_new_tokens` tunes `eval_table_size`, which is off, so it changes nothing." in caplog.text
    problems = problems_of(base_config(tmp_path, eval_max_new_tokens=128, eval_table_size=5))
    assert [p.split(" ")[0] for p in problems] == ["`eval_max_new_tokens`", "`eval_table_size`"]
    assert all("is not supported yet" in p for p in problems)
