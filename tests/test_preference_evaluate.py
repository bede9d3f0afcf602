"""`hellbender evaluate` after KTO, ORPO, SimPO and reward-model runs (DPO / IPO: tests/test_preference_e2e.py): each
prints the preference accuracy the run reached on its held-out pairs, with the same numbers its trainer logged when
it scored the same rows with the same final model at its last step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import yaml

from hellbender.use.kto_pairs import NO_PAIRS, pair_margins, pair_summary
from tests.helpers import base_config, invoke, trainer_state

STEPS, EVAL_PAIRS, LEARNING_RATE = 8, 16, 1e-2
LORA = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}


# A preference the tiny model learns in a few steps: a kind word over an unkind one, about varied things.
THINGS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "window",
    "candle",
    "forest",
    "bridge",
    "mirror",
    "violin",
    "harbor",
    "lantern",
    "meadow",
    "castle",
]
KIND, UNKIND = ("Lovely", "Wonderful", "Splendid", "Delightful"), ("Awful", "Horrible", "Dreadful", "Miserable")


def pairs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        thing = rng.choice(THINGS)
        rows.append(
            {
                "prompt": f"Describe the {thing} number {seed * 1000 + i}.",
                "chosen": f"{rng.choice(KIND)} {thing}.",
                "rejected": f"{rng.choice(UNKIND)} {thing}.",
            }
        )
    return rows


def data_file(path: Path, rows: list[dict], kto: bool) -> str:
    """`chatml.prompt_pairs` rows: the pairs, or for KTO every pair's chosen answer (desirable) and its rejected one
    (undesirable), each a row."""
    if kto:
        rows = [
            {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in rows
            for side in ("chosen", "rejected")
        ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def run_config(root: Path, method: str, adapter: bool) -> tuple[Path, dict]:
    """A short run of `method` on the tiny Llama (LoRA, or all weights), scoring its held-out rows (one batch) at its
    last step."""
    kto = method == "kto"
    settings: dict = dict(
        **(LORA if adapter else {}),
        learning_rate=LEARNING_RATE if adapter else LEARNING_RATE / 10,
        micro_batch_size=8,
        max_steps=STEPS,
        save_steps=STEPS,
        eval_steps=STEPS,
        eval_batch_size=2 * EVAL_PAIRS,  # one evaluation batch: the logged means are over every row
        datasets=[{"path": data_file(root / "train.jsonl", pairs(96, 1), kto), "type": "chatml.prompt_pairs"}],
        test_datasets=[
            {"path": data_file(root / "test.jsonl", pairs(EVAL_PAIRS, 2), kto), "type": "chatml.prompt_pairs"}
        ],
    )
    if method == "reward_model":
        settings["reward_model"] = True
    else:
        settings["rl"] = method
    if method == "simpo":
        settings.update(rl_beta=2.0, cpo_alpha=0.0)
    raw = base_config(root, **settings)
    config = root / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    return config, raw


def last_eval(output_dir: str) -> dict:
    """The evaluation metrics the run logged at its last step."""
    return [e for e in trainer_state(output_dir)["log_history"] if "eval_loss" in e and e["step"] == STEPS][-1]


# TRL's logged metric -> `hellbender evaluate`'s name, per method, and the accuracy the tiny task reaches.
PAIR_METRICS = {
    "eval_loss": "loss",
    "eval_rewards/accuracies": "preference_accuracy",
    "eval_rewards/margins": "mean_margin",
    "eval_rewards/chosen": "chosen_reward",
    "eval_logps/rejected": "rejected_logp",
}
AGREE = {
    **dict.fromkeys(("orpo", "simpo"), {**PAIR_METRICS, "eval_nll_loss": "nll_loss"}),
    "reward_model": {"eval_loss": "loss", "eval_accuracy": "preference_accuracy", "eval_margin": "mean_margin"},
    "kto": {"eval_loss": "loss", "eval_kl": "kl", "eval_rewards/chosen": "desirable_reward"},
}
LEARNED = 0.9  # an untrained model ranks about half of the pairs right


@pytest.mark.parametrize(
    ("method", "adapter"),
    [("orpo", True), ("simpo", True), ("kto", True), ("kto", False), ("reward_model", True)],
    ids=["orpo", "simpo", "kto", "kto-full-weights", "reward_model"],
)
def test_evaluate_prints_what_the_run_learned_as_its_trainer_scored_it(tmp_path, method, adapter):
    """KTO with all weights trained: the reference is the base model loaded again."""
    config, raw = run_config(tmp_path, method, adapter)
    trained = invoke("train", config)
    assert trained.exit_code == 0, f"{trained.output}\n{trained.exception!r}"
    result = invoke("evaluate", config)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    scores = json.loads(result.stdout)
    logged = last_eval(raw["output_dir"])
    for trl, ours in AGREE[method].items():
        assert scores[ours] == pytest.approx(logged[trl], abs=1e-6), ours
    assert scores["preference_accuracy"] >= LEARNED and scores["mean_margin"] > 0
    if method == "kto":
        # Every held-out prompt has one answer of each kind, scored in one batch: the mean margin of the pairs is the
        # desirable rows' mean reward minus the undesirable rows', which the trainer logs.
        assert scores["pairs"] == EVAL_PAIRS and scores["desirable_rows"] == scores["undesirable_rows"] == EVAL_PAIRS
        assert scores["mean_margin"] == pytest.approx(logged["eval_rewards/margins"], abs=1e-6)
    else:
        assert scores["pairs"] == scores["rows"] == EVAL_PAIRS


def test_kto_rows_pair_up_by_prompt_and_label():
    rows = [
        {"prompt_ids": [1, 2], "label": True},
        {"prompt_ids": [3], "label": False},
        {"prompt_ids": [1, 2], "label": False},
        {"prompt_ids": [4], "label": True},  # no undesirable answer to this prompt: no pair
        {"prompt_ids": [3], "label": True},
        {"prompt_ids": [3], "label": True},
    ]
    rewards = [0.5, 0.25, -0.5, 9.0, 1.0, 0.0]
    assert pair_margins(rows, rewards) == [1.0, 0.75, -0.25]
    assert pair_summary(rows, rewards) == {
        "desirable_rows": 4,
        "undesirable_rows": 2,
        "preference_accuracy": 2 / 3,
        "mean_margin": pytest.approx(0.5),
        "pairs": 3,
    }


def test_unpaired_kto_rows_report_the_rewards_per_label_and_say_so():
    rows = [{"prompt_ids": [1], "label": True}, {"prompt_ids": [2], "label": False}]
    summary = pair_summary(rows, [0.5, -0.5])
    assert summary == {"desirable_rows": 1, "undesirable_rows": 1, "pairs": 0, "note": NO_PAIRS}
    assert "no prompt" in summary["note"] and "desirable_reward" in summary["note"]
