"""A reward model as a reward function of online RL: a `trl.reward_funcs` entry that is a directory (relative to the
config's) of a sequence-classification checkpoint, checked at validation and scoring each completion at training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hellbender.errors import ConfigError
from tests.test_grpo import grpo_config, recording_trainer

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_path) -> Path:
    """A tiny reward model (the tiny Llama with a seeded one-score head) and its tokenizer, saved as `reward_model:
    true` saves one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    target = tmp_path_factory.mktemp("scorer") / "scorer"
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1, dtype=torch.float32)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ between completions
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def test_a_reward_models_scores_are_the_rewards_grpo_trains_with(tmp_path, reward_model_dir):
    """Each completion's reward is the reward model's score of the prompt text followed by the completion text, as
    the model's own tokenizer reads them; the advantages are those scores relative to their group."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "scorer").symlink_to(reward_model_dir)
    cfg = grpo_config(tmp_path, {"reward_funcs": ["models/scorer"]}, max_steps=1, micro_batch_size=16)
    trainer, batches = recording_trainer(cfg)
    trainer.train()
    batch = batches[0]
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    scorer = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    prompts = tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    completions = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        rewards = scorer(**inputs).logits[:, 0]
    groups = rewards.view(-1, 4)
    expected = ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)).flatten()
    assert rewards.std() > 0
    torch.testing.assert_close(batch["advantages"].cpu(), expected, atol=1e-4, rtol=1e-4)
    logged = [e for e in trainer.state.log_history if "reward" in e][0]
    assert logged["rewards/scorer/mean"] == pytest.approx(float(rewards.mean()), abs=1e-5)


def test_a_reward_model_and_a_reward_function_score_together(tmp_path, reward_model_dir):
    """Absolute directories work too, and weights apply to models as to functions."""
    cfg = grpo_config(
        tmp_path,
        {"reward_funcs": [str(reward_model_dir), "rewards.even_share"], "reward_weights": [0.5, 1.0]},
        max_steps=1,
    )
    trainer, _ = recording_trainer(cfg)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "reward" in e][0]
    expected = 0.5 * logged["rewards/scorer/mean"] + logged["rewards/even_share/mean"]
    assert logged["reward"] == pytest.approx(expected, abs=1e-5)


def _write_config(directory: Path, **config) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("entry", "needles"),
    [
        ("./models/missing", ["./models/missing", "no directory", "trl.reward_funcs_dir"]),
        ("causal", ["causal", "LlamaForCausalLM, not a sequence-classification model", "reward_model: true"]),
        ("two_labels", ["two_labels", "scores 2 labels", "num_labels: 1"]),
        ("adapter", ["adapter", "LoRA adapter", "merge-lora"]),
        ("empty", ["empty", "no `config.json`"]),
    ],
)
def test_a_reward_model_that_cannot_score_is_refused_at_validation(tmp_path, entry, needles):
    _write_config(tmp_path / "causal", architectures=["LlamaForCausalLM"])
    _write_config(
        tmp_path / "two_labels", architectures=["LlamaForSequenceClassification"], id2label={"0": "a", "1": "b"}
    )
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as error:
        grpo_config(tmp_path, {"reward_funcs": [entry]})
    message = str(error.value)
    assert "\n\n" not in message  # one paragraph
    for needle in needles:
        assert needle in message, message


def test_a_hub_reward_model_offline_must_be_in_the_cache(tmp_path):
    with pytest.raises(ConfigError, match=r"`someone/reward-model`.*nor a hub model in the local cache"):
        grpo_config(tmp_path, {"reward_funcs": ["someone/reward-model"]})


def test_a_reward_model_that_fails_to_load_stops_training_with_one_paragraph(tmp_path):
    """What validation cannot see (here: no weights beside a valid-looking config) is one paragraph at training."""
    import yaml

    from tests.helpers import assert_user_error, invoke
    from tests.test_grpo import grpo_settings

    _write_config(tmp_path / "broken", architectures=["LlamaForSequenceClassification"], id2label={"0": "score"})
    raw = grpo_settings(tmp_path, {"reward_funcs": ["broken"]})
    (tmp_path / "config.yml").write_text(yaml.safe_dump(raw))
    assert_user_error(invoke("train", tmp_path / "config.yml"), "`broken` as a reward model, and loading it failed")
