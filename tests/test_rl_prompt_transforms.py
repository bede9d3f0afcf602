"""Axolotl's prompt transforms of online RL (`datasets[i].type: module.function`): a function in a Python file next
to the config, called as Axolotl calls it, maps raw rows to prompt rows; bad transforms are one paragraph naming the
entry and the row, and the type is refused outside `rl: grpo` / `rl: rloo`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hellbender.config.loading import load_config, validate_config
from hellbender.errors import ConfigError, DataError
from tests.helpers import base_config
from tests.test_grpo import REWARDS, grpo_config, logged_rewards

# Axolotl's documented GSM8K transform (docs/rlhf.qmd), and transforms that go wrong in each way a user's can.
TRANSFORMS = """
def oai_gsm8k_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        label = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [{"role": "user", "content": example["question"]}],
            "answer": label,
            "eos": tokenizer.eos_token,
        }

    return transform_fn, {"remove_columns": ["question"]}


def text_prompt(cfg, dataset_idx=0, **kwargs):
    return (lambda row: {"prompt": f"{cfg.base_model} entry {dataset_idx}: {row['question']}"}), {
        "remove_columns": ["question", "answer", "not_a_column"]  # columns the rows lack are left out, as Axolotl does
    }


def everything_replaced(cfg, **kwargs):
    return (lambda row: {"prompt": row["question"].upper()}), {"remove_columns": "__all__"}


def fails_on_row_two(cfg, **kwargs):
    def transform(row):
        if row["question"].endswith("2?"):
            raise KeyError("no answer")
        return {"prompt": row["question"]}

    return transform


def no_prompt(cfg, **kwargs):
    return lambda row: {"question_text": row["question"]}


def batched(cfg, **kwargs):
    return (lambda row: {"prompt": row["question"]}), {"batched": True}


def not_a_dict(cfg, **kwargs):
    return lambda row: row["question"]
"""


def raw_dir(tmp_path: Path) -> Path:
    """GSM8K-shaped rows (`question`, `answer` ending in `#### N`), the transforms and the reward functions."""
    (tmp_path / "transforms.py").write_text(TRANSFORMS)
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i} and {i} make {2 * i}\n#### {2 * i:,}"} for i in range(8)
    ]
    rows[5]["answer"] = "#### 1,000"
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def transformed_config(tmp_path: Path, transform: str, **overrides):
    raw_dir(tmp_path)
    return grpo_config(tmp_path, datasets=[{"path": str(tmp_path / "raw.jsonl"), "type": transform}], **overrides)


def rows_of(cfg):
    from hellbender.data.grpo_rows import grpo_rows
    from hellbender.models.loading import load_tokenizer_and_processor

    tokenizer, _ = load_tokenizer_and_processor(cfg)
    return grpo_rows(cfg, tokenizer), tokenizer


def test_axolotls_gsm8k_transform_makes_the_prompt_rows(tmp_path):
    cfg = transformed_config(tmp_path, "transforms.oai_gsm8k_transform")
    rows, tokenizer = rows_of(cfg)
    assert sorted(rows.column_names) == ["answer", "eos", "hellbender_row", "prompt"]  # `question` removed
    assert rows[3]["prompt"] == [{"role": "user", "content": "What is 3 + 3?"}]
    assert [rows[i]["answer"] for i in (3, 5)] == ["6", "1000"]
    assert rows[0]["eos"] == tokenizer.eos_token  # the `tokenizer` parameter receives the run's tokenizer
    assert cfg.datasets[0].type == "transforms.oai_gsm8k_transform"  # the resolved config keeps it


def test_a_transform_is_called_with_the_config_and_the_entrys_index(tmp_path):
    raw_dir(tmp_path)
    entry = {"path": str(tmp_path / "raw.jsonl")}
    cfg = grpo_config(
        tmp_path,
        datasets=[{**entry, "type": "transforms.everything_replaced"}, {**entry, "type": "transforms.text_prompt"}],
    )
    rows, _ = rows_of(cfg)
    assert len(rows) == 16 and sorted(rows.column_names) == ["hellbender_row", "prompt"]
    assert rows[1]["prompt"] == "WHAT IS 1 + 1?"
    assert rows[9]["prompt"] == "hellbender/tiny-llama entry 1: What is 1 + 1?"


def test_a_test_datasets_transform_is_its_own_entrys(tmp_path):
    """The evaluation prompts of `test_datasets` go through their own entry's transform, not `datasets`' entry of the
    same index."""
    from hellbender.data.grpo_rows import grpo_split

    raw_dir(tmp_path)
    entry = {"path": str(tmp_path / "raw.jsonl")}
    cfg = grpo_config(
        tmp_path,
        datasets=[{**entry, "type": "transforms.everything_replaced"}],
        test_datasets=[{**entry, "type": "transforms.text_prompt"}],
    )
    train, held = grpo_split(cfg)
    assert train[1]["prompt"] == "WHAT IS 1 + 1?"
    assert held[1]["prompt"] == "hellbender/tiny-llama entry 0: What is 1 + 1?"


@pytest.mark.parametrize(
    ("transform", "error", "needles"),
    [
        (
            "transforms.fails_on_row_two",
            DataError,
            ["`transforms.fails_on_row_two`", "datasets[0]", "row 2", "no answer"],
        ),
        ("transforms.no_prompt", DataError, ["no `prompt` column after its transform", "question_text"]),
        ("transforms.batched", ConfigError, ["datasets[0].type", "`batched`", "remove_columns"]),
        ("transforms.not_a_dict", DataError, ["returned str for row 0", "dict"]),
    ],
)
def test_a_transform_that_goes_wrong_is_one_paragraph(tmp_path, transform, error, needles):
    cfg = transformed_config(tmp_path, transform)
    with pytest.raises(error) as raised:
        rows_of(cfg)
    message = str(raised.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("transform", "overrides", "needles"),
    [
        ("missing.transform", {}, ["`datasets[0].type` names `missing.transform`", "missing.py"]),
        ("transforms.absent", {}, ["`datasets[0].type`", "has no `absent`", "dataset_idx"]),
        ("chat_template", {}, ["type: chat_template", "name a transform `module.function`"]),
    ],
)
def test_transform_names_are_checked_at_validation(tmp_path, transform, overrides, needles):
    with pytest.raises(ConfigError) as raised:
        transformed_config(tmp_path, transform, **overrides)
    for needle in needles:
        assert needle in str(raised.value), str(raised.value)


def test_a_transform_type_outside_online_rl_is_refused(tmp_path):
    raw = base_config(tmp_path, datasets=[{"path": "raw.jsonl", "type": "transforms.oai_gsm8k_transform"}])
    with pytest.raises(ConfigError) as raised:
        validate_config(raw)
    assert "`datasets[0].type: transforms.oai_gsm8k_transform`" in str(raised.value)
    assert "only for the prompt rows of `rl: grpo` and `rl: rloo`" in str(raised.value)


def test_grpo_trains_on_transformed_rows(tmp_path):
    from hellbender.train.run import train

    cfg = transformed_config(tmp_path, "transforms.oai_gsm8k_transform", max_steps=2)
    train(cfg)
    assert len(logged_rewards(Path(cfg.output_dir))) == 2
    resolved = load_config(Path(cfg.output_dir) / "hellbender_config.yml")  # as a resumed run reads it
    assert resolved.datasets[0].type == "transforms.oai_gsm8k_transform"
