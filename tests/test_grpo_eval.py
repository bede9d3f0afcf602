"""Evaluation of online RL (`rl: grpo`): during training, the completions generated for the evaluation prompts
(held out of `datasets` by `val_set_size`, or `test_datasets`) are scored by the run's reward functions and the
logged `eval_` rewards are exactly those scores; `hellbender evaluate` reports the same kind of rewards for the
trained model, reproducibly; evaluation prompts that a reward function cannot score are refused by name."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import yaml

from hellbender.config.loading import load_config, validate_config
from hellbender.errors import DataError
from tests.helpers import assert_user_error, invoke, trainer_state
from tests.test_grpo import grpo_settings

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

# Two functions over the completions' text, one also reading the rows' `number`, weighted 1 and 0.5.
EVAL_REWARDS = """
def vowel_share(prompts, completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def number_bonus(prompts, completions, number, **kwargs):
    return [n % 3 + 0.5 * (len(c) % 2) for n, c in zip(number, completions)]
"""
FUNCTIONS = ["eval_rewards.vowel_share", "eval_rewards.number_bonus"]
WEIGHTS = [1.0, 0.5]
HELD_OUT = 4  # prompts; 4 completions each, evaluated in 2 batches of 8


def eval_config_file(root: Path, **overrides) -> Path:
    """A config file for a 2-step GRPO run evaluating after each step, its reward file next to it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "eval_rewards.py").write_text(EVAL_REWARDS)
    trl = {"reward_funcs": FUNCTIONS, "reward_weights": WEIGHTS, "log_completions": True}
    trl["num_completions_to_print"] = 1
    settings = {"max_steps": 2, "val_set_size": HELD_OUT, "eval_steps": 1, "learning_rate": 2e-2}
    raw = grpo_settings(root, trl, **{**settings, **overrides})
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(raw))
    return path


def reward_module(root: Path):
    spec = importlib.util.spec_from_file_location("recomputed_eval_rewards", root / "eval_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recomputed(root: Path, completions: list[dict]) -> list[list[float]]:
    """Each completion's scores by the reward functions, called here on its text and its row's `number` (row i of
    the prompts file has `number` i and `prompt` `question i`)."""
    module = reward_module(root)
    assert [c["prompt"] for c in completions] == [f"question {c['row']}" for c in completions]
    prompts, texts = [c["prompt"] for c in completions], [c["completion"] for c in completions]
    vowels = module.vowel_share(prompts=prompts, completions=texts)
    bonus = module.number_bonus(prompts=prompts, completions=texts, number=[c["row"] for c in completions])
    return [list(pair) for pair in zip(vowels, bonus, strict=True)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The directory of one trained 2-step run (shared: training is the slow part)."""
    from hellbender.train.run import train

    root = tmp_path_factory.mktemp("grpo_eval")
    train(load_config(eval_config_file(root)))
    return root


def test_the_logged_eval_rewards_are_the_reward_functions_scores_of_the_eval_completions(trained_run):
    from hellbender.data.grpo_rows import ROW_COLUMN, grpo_split

    out = trained_run / "out"
    evals = [e for e in trainer_state(out)["log_history"] if "eval_reward" in e]
    assert [e["step"] for e in evals] == [1, 2]
    cfg = load_config(trained_run / "config.yml")
    train_rows, eval_rows = grpo_split(cfg)
    held = set(eval_rows[ROW_COLUMN])
    assert len(held) == HELD_OUT and not held & set(train_rows[ROW_COLUMN])  # disjoint, and nothing lost:
    assert held | set(train_rows[ROW_COLUMN]) == set(range(32))
    assert set(grpo_split(cfg)[1][ROW_COLUMN]) == held  # the same rows every time
    for logged in evals:
        completions = read_jsonl(out / "completions" / f"eval_completions_{logged['step']:05d}.jsonl")
        assert len(completions) == HELD_OUT * 4 and {c["row"] for c in completions} == held
        scores = recomputed(trained_run, completions)
        for completion, pair in zip(completions, scores, strict=True):
            assert list(completion["rewards"].values()) == pytest.approx(pair, abs=1e-6)
        # TRL logs the mean over evaluation batches (8 completions each) of each batch's statistic
        batches = [range(0, 8), range(8, 16)]
        totals = [WEIGHTS[0] * a + WEIGHTS[1] * b for a, b in scores]
        assert logged["eval_reward"] == pytest.approx(
            statistics.fmean(statistics.fmean(totals[i] for i in b) for b in batches)
        )
        assert logged["eval_reward_std"] == pytest.approx(
            statistics.fmean(statistics.stdev([totals[i] for i in b]) for b in batches), rel=1e-5
        )
        for k, name in enumerate(("vowel_share", "number_bonus")):
            assert logged[f"eval_rewards/{name}/mean"] == pytest.approx(statistics.fmean(p[k] for p in scores))
        lengths = [c["completion_tokens"] for c in completions]
        assert logged["eval_completions/mean_length"] == pytest.approx(statistics.fmean(lengths))
        assert max(lengths) <= 4  # `max_completion_length`
    assert len({e["eval_reward"] for e in evals}) == 2  # two evaluations, two sets of completions
    report = (out / "report" / "report.md").read_text()
    assert (
        f"- Evaluation reward (completions generated for the evaluation prompts): {evals[-1]['eval_reward']:.4g}"
        in report
    )
    assert "- Evaluation loss" not in report


def test_hellbender_evaluate_reports_the_rewards_of_its_recorded_completions_reproducibly(trained_run):
    config = trained_run / "config.yml"
    result = invoke("evaluate", config)
    assert result.exit_code == 0, result.output
    results = json.loads((trained_run / "out" / "eval_results.json").read_text())
    assert json.loads(result.stdout) == results
    assert {"reward", "reward_std", "rewards", "completion_length", "prompts", "completions", "seed"} <= set(results)
    assert (results["prompts"], results["completions"], results["step"]) == (HELD_OUT, HELD_OUT * 4, 2)
    assert results["eval_data"] == "val_set_size: 4 of datasets" and not results["eval_rows_also_trained"]
    completions = read_jsonl(Path(results["completions_file"]))
    scores = recomputed(trained_run, completions)
    totals = [WEIGHTS[0] * a + WEIGHTS[1] * b for a, b in scores]
    assert results["reward"] == pytest.approx(statistics.fmean(totals))
    assert results["reward_std"] == pytest.approx(statistics.stdev(totals))
    assert results["rewards"] == pytest.approx(
        {f: statistics.fmean(p[k] for p in scores) for k, f in enumerate(FUNCTIONS)}
    )
    assert results["completion_length"] == pytest.approx(statistics.fmean(c["completion_tokens"] for c in completions))

    again = invoke("evaluate", config, "--output", trained_run / "again.json")
    assert again.exit_code == 0, again.output
    assert read_jsonl(trained_run / "again_completions.jsonl") == completions  # the same seed, the same completions
    assert json.loads((trained_run / "again.json").read_text())["reward"] == results["reward"]


def test_eval_prompts_a_reward_function_cannot_score_are_refused_by_key_and_row(tmp_path):
    from hellbender.data.grpo_rows import grpo_split

    config = eval_config_file(tmp_path, val_set_size=0)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "question 0"}) + "\n")
    raw = yaml.safe_load(config.read_text())
    raw["test_datasets"] = [{"path": str(tmp_path / "eval.jsonl")}]
    config.write_text(yaml.safe_dump(raw))
    assert_user_error(invoke("train", config), "`test_datasets[0]`", "no `number` column", "eval_rewards.number_bonus")

    rows = [{"prompt": "question 0", "number": 0}, {"prompt": "question 1", "number": None}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"Row 1 of `test_datasets\[0\]` .* no value in `number`"):
        grpo_split(load_config(config))
    with pytest.raises(DataError, match=r"val_set_size: 32.*leaves no training prompts out of 32"):
        trl = {**raw["trl"], "reward_funcs_dir": str(tmp_path)}
        grpo_split(validate_config({**raw, "trl": trl, "test_datasets": [], "val_set_size": 32}))
