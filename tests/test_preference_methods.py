"""KTO, ORPO, SimPO and reward models on TRL's trainers, fed hellbender's prepared (already tokenized) rows.

A learnable synthetic preference: every answer is a shared body followed by one marker token and EOS; chosen answers
end with a marker from GOOD, rejected ones with a marker from BAD. An untrained tiny model prefers either about half
the time; a trained one must prefer the chosen answer of pairs it never saw.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

from hellbender.config.loading import validate_config
from hellbender.train.methods.legacy_pairs import legacy_pair_columns
from tests.helpers import PREFERENCE_DATA, base_config, preference_trainer

WORDS = range(100, 300)  # prompt and body tokens
GOOD = tuple(range(300, 316))
BAD = tuple(range(320, 336))


def pairs(n: int, seed: int, eos: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = rng.choices(WORDS, k=rng.randint(3, 6))
        body = rng.choices(WORDS, k=rng.randint(1, 3))
        rows.append(
            {
                "prompt_ids": prompt,
                "chosen_ids": body + [rng.choice(GOOD), eos],
                "rejected_ids": body + [rng.choice(BAD), eos],
            }
        )
    return rows


def paired_dataset(n: int, seed: int, eos: int) -> Dataset:
    return Dataset.from_list(pairs(n, seed, eos))


def unpaired_dataset(n: int, seed: int, eos: int) -> Dataset:
    """KTO's rows: each pair gives one desirable or one undesirable row (never both), in shuffled order."""
    rng = random.Random(seed + 1)
    rows = []
    for pair in pairs(n, seed, eos):
        label = rng.random() < 0.5
        answer = pair["chosen_ids"] if label else pair["rejected_ids"]
        rows.append({"prompt_ids": pair["prompt_ids"], "completion_ids": answer, "label": label})
    return Dataset.from_list(rows)


# A KTO-capable type for validation; the tests hand the trainers prepared rows directly.
KTO_DATA = [{"path": PREFERENCE_DATA, "type": "chatml.prompt_pairs"}]
PAIR_DATA = [{"path": PREFERENCE_DATA, "type": "chat_template.default"}]
LORA = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj", "v_proj", "o_proj"]}


def method_config(tmp_path, **overrides):
    """A config of `hellbender train` for a preference method: the tiny Llama, fp32, 8 rows a micro-batch."""
    kto = overrides.get("rl") == "kto"
    settings = {
        "datasets": KTO_DATA if kto else PAIR_DATA,
        "micro_batch_size": 8,
        "max_steps": 40,
        "learning_rate": 3e-3,
        "save_steps": 1000,
        **overrides,
    }
    return validate_config(base_config(tmp_path, **settings))


@torch.no_grad()
def answer_logps(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Per-token log-probabilities of `answer` after `prompt`, computed from the model's logits directly."""
    ids = torch.tensor([prompt + answer])
    logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
    return logits.log_softmax(-1)[positions, torch.tensor(answer)]


def preference_accuracy(model, dataset: Dataset) -> float:
    """How often the policy gives the chosen answer a higher log-probability than the rejected one."""
    was_training = model.training
    model.eval()
    wins = [
        answer_logps(model, r["prompt_ids"], r["chosen_ids"]).sum()
        > answer_logps(model, r["prompt_ids"], r["rejected_ids"]).sum()
        for r in dataset
    ]
    model.train(was_training)
    return sum(bool(w) for w in wins) / len(wins)


@torch.no_grad()
def reward_scores(model, rows, side: str) -> torch.Tensor:
    model.eval()
    return torch.stack([model(input_ids=torch.tensor([r["prompt_ids"] + r[side]])).logits[0, 0].float() for r in rows])


def ranking_accuracy(model, dataset: Dataset) -> float:
    rows = list(dataset)
    return (reward_scores(model, rows, "chosen_ids") > reward_scores(model, rows, "rejected_ids")).float().mean().item()


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# --- the arguments every method is given -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kto", "orpo", "simpo", "reward_model"])
def test_every_method_gets_the_runs_training_arguments(tmp_path, method):
    """`training_arguments` builds each method's TRL config: TRL's own defaults (checkpointing and bf16 on, learning
    rate 1e-6, logging every 10 steps, dropout off) do not apply."""
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.schedule import plan_schedule

    kind = {"reward_model": True} if method == "reward_model" else {"rl": method}
    cfg = method_config(tmp_path, learning_rate=2e-3, logging_steps=3, gradient_accumulation_steps=2, **kind)
    config_class, settings = preference_method(cfg).arguments(cfg)
    args = training_arguments(cfg, plan_schedule(cfg, 64, 1), False, False, config_class, settings)
    assert type(args) is config_class
    assert (args.gradient_checkpointing, args.bf16, args.learning_rate, args.logging_steps) == (False, False, 2e-3, 3)
    assert args.gradient_accumulation_steps == 2 and args.disable_dropout is False
    expected = {
        "kto": {
            "beta": 0.1,
            "desirable_weight": 1.0,
            "undesirable_weight": 1.0,
            "train_sampling_strategy": "sequential",
        },
        "orpo": {"beta": 0.1},
        "simpo": {"beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 1.0, "loss_type": "simpo"},
        "reward_model": {"max_length": None},
    }[method]
    assert {key: getattr(args, key) for key in expected} == expected


# --- KTO -----------------------------------------------------------------------------------------------------------


def test_kto_step_zero_has_no_kl_and_no_rewards(tmp_path, tiny_tokenizer):
    """With the policy equal to the reference (a fresh adapter: the base with it disabled), the log-ratios are 0:
    KL, rewards and margins are exactly 0 and every row's loss is weight * (1 - sigmoid(0)) = weight / 2."""
    data = unpaired_dataset(16, seed=0, eos=tiny_tokenizer.eos_token_id)
    cfg = method_config(tmp_path, rl="kto", max_steps=1, kto_desirable_weight=1.5, kto_undesirable_weight=0.5, **LORA)
    trainer = preference_trainer(cfg, data)
    assert set(trainer.model.peft_config) == {"default"}  # no second ("ref") adapter in memory
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.data_collator(rows)
    # Only the answer is scored: the completion mask covers exactly the answer tokens.
    for i, row in enumerate(rows):
        n_prompt, n_answer = len(row["prompt_ids"]), len(row["completion_ids"])
        assert batch["input_ids"][i, : n_prompt + n_answer].tolist() == row["prompt_ids"] + row["completion_ids"]
        assert batch["completion_mask"][i].tolist()[: n_prompt + n_answer] == [0] * n_prompt + [1] * n_answer
    labels = torch.tensor([row["label"] for row in rows])
    expected = torch.where(labels, 1.5, 0.5).mul(0.5).mean()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-7)

    trainer.train()
    first = trainer.state.log_history[0]
    assert first["kl"] == 0.0
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0 and first["rewards/margins"] == 0.0


def test_kto_shuffles_its_rows_once_with_the_seed(tmp_path, tiny_tokenizer):
    """TRL reads KTO rows in order (each row's KL completion is its neighbour's answer), so the rows are shuffled
    before training: the same order for the same seed, another for another seed, no row lost."""
    data = unpaired_dataset(32, seed=0, eos=tiny_tokenizer.eos_token_id)

    def order(seed: int) -> list:
        cfg = method_config(tmp_path / str(seed), rl="kto", max_steps=1, seed=seed, **LORA)
        return [
            (tuple(r["prompt_ids"]), tuple(r["completion_ids"])) for r in preference_trainer(cfg, data).train_dataset
        ]

    given = [(tuple(r["prompt_ids"]), tuple(r["completion_ids"])) for r in data]
    first, again, other = order(1), order(1), order(2)
    assert first == again and first != given and first != other
    assert sorted(first) == sorted(given)


def test_kto_full_fine_tuning_step_zero_with_a_frozen_reference_copy(tmp_path, tiny_tokenizer):
    data = unpaired_dataset(16, seed=0, eos=tiny_tokenizer.eos_token_id)
    trainer = preference_trainer(method_config(tmp_path, rl="kto", max_steps=1), data)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["kl"] == 0.0 and first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0


def test_kto_learns_a_preference_from_unpaired_rows(tmp_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = unpaired_dataset(256, seed=1, eos=eos), paired_dataset(32, seed=2, eos=eos)
    trainer = preference_trainer(method_config(tmp_path, rl="kto", max_steps=20), train)
    before = preference_accuracy(trainer.model, held_out)
    trainer.train()
    after = preference_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)
    margins = logged(trainer, "rewards/margins")
    assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5


# --- ORPO and SimPO -----------------------------------------------------------------------------------------------


def test_pairs_become_the_legacy_trainer_columns_without_a_token_changed():
    row = {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]}
    assert legacy_pair_columns(row) == {
        "prompt_input_ids": [5, 6, 7],
        "prompt_attention_mask": [1, 1, 1],
        "chosen_input_ids": [5, 6, 7, 8, 9],
        "chosen_attention_mask": [1, 1, 1, 1, 1],
        "chosen_labels": [-100, -100, -100, 8, 9],
        "rejected_input_ids": [5, 6, 7, 10],
        "rejected_attention_mask": [1, 1, 1, 1],
        "rejected_labels": [-100, -100, -100, 10],
    }


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    return torch.log(-torch.expm1(x))


def hand_terms(model, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Length-averaged answer log-probs of chosen and rejected, and the NLL of the chosen answers' tokens."""
    chosen = [answer_logps(model, r["prompt_ids"], r["chosen_ids"]) for r in rows]
    rejected = [answer_logps(model, r["prompt_ids"], r["rejected_ids"]) for r in rows]
    mean_chosen = torch.stack([c.mean() for c in chosen])
    mean_rejected = torch.stack([r.mean() for r in rejected])
    nll = -torch.cat(chosen).mean()  # prompt tokens take no part
    return mean_chosen, mean_rejected, nll


def test_orpo_step_zero_loss_matches_a_hand_computation(tmp_path, tiny_tokenizer):
    data = paired_dataset(8, seed=3, eos=tiny_tokenizer.eos_token_id)
    trainer = preference_trainer(method_config(tmp_path, rl="orpo", orpo_alpha=0.25), data)
    rows = [data[i] for i in range(8)]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    mean_chosen, mean_rejected, nll = hand_terms(trainer.model, rows)
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    expected = nll - 0.25 * F.logsigmoid(log_odds).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert trainer._stored_metrics["train"]["nll_loss"][-1] == pytest.approx(nll.item(), rel=1e-5)


def test_orpo_learns_a_preference_without_a_reference_model(tmp_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=4, eos=eos), paired_dataset(32, seed=5, eos=eos)
    trainer = preference_trainer(method_config(tmp_path, rl="orpo", max_steps=12), train)
    before = preference_accuracy(trainer.model, held_out)
    assert not hasattr(trainer, "ref_model") or trainer.ref_model is None
    trainer.train()
    after = preference_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)
    margins = logged(trainer, "rewards/margins")
    assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5


def test_simpo_step_zero_loss_matches_a_hand_computation(tmp_path, tiny_tokenizer):
    data = paired_dataset(8, seed=6, eos=tiny_tokenizer.eos_token_id)
    beta, gamma, alpha = 2.0, 0.5, 0.3
    cfg = method_config(tmp_path, rl="simpo", rl_beta=beta, simpo_gamma=gamma, cpo_alpha=alpha)
    trainer = preference_trainer(cfg, data)
    rows = [data[i] for i in range(8)]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    mean_chosen, mean_rejected, nll = hand_terms(trainer.model, rows)
    expected = -F.logsigmoid(beta * (mean_chosen - mean_rejected) - gamma).mean() + alpha * nll
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_simpo_learns_a_preference(tmp_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=7, eos=eos), paired_dataset(32, seed=8, eos=eos)
    cfg = method_config(tmp_path, rl="simpo", max_steps=12, rl_beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0)
    trainer = preference_trainer(cfg, train)
    before = preference_accuracy(trainer.model, held_out)
    trainer.train()
    after = preference_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)


# --- reward model --------------------------------------------------------------------------------------------------


def test_reward_model_ranks_held_out_pairs_and_loads_in_plain_transformers(tmp_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=9, eos=eos), paired_dataset(32, seed=10, eos=eos)
    trainer = preference_trainer(method_config(tmp_path, reward_model=True, max_steps=12), train)
    assert trainer.train_dataset[0]["chosen_ids"] == train[0]["prompt_ids"] + train[0]["chosen_ids"]
    before = ranking_accuracy(trainer.model, held_out)
    trainer.train()
    after = ranking_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)
    assert logged(trainer, "accuracy") and logged(trainer, "margin")

    out = tmp_path / "reward"
    trainer.save_model(str(out))
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tiny_tokenizer.pad_token_id
    rows = list(held_out)
    for side in ("chosen_ids", "rejected_ids"):
        torch.testing.assert_close(reward_scores(loaded, rows, side), reward_scores(trainer.model, rows, side))


def test_reward_model_step_zero_loss_with_centring_matches_a_hand_computation(tmp_path, tiny_tokenizer):
    """-log sigmoid(r_chosen - r_rejected), plus `center_rewards_coefficient` x mean (r_chosen + r_rejected)^2."""
    data = paired_dataset(8, seed=13, eos=tiny_tokenizer.eos_token_id)
    trainer = preference_trainer(method_config(tmp_path, reward_model=True, center_rewards_coefficient=0.5), data)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    rows = [data[i] for i in range(8)]
    chosen, rejected = (
        reward_scores(trainer.model, rows, "chosen_ids"),
        reward_scores(trainer.model, rows, "rejected_ids"),
    )
    centring = 0.5 * ((chosen + rejected) ** 2).mean()
    expected = -F.logsigmoid(chosen - rejected).mean() + centring
    assert centring > 1e-4  # the term is large enough to be seen
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_reward_model_with_lora_trains_and_saves_the_score_head(tmp_path, tiny_model_path, tiny_tokenizer):
    from peft import PeftModel
    from safetensors.torch import load_file

    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=11, eos=eos), paired_dataset(32, seed=12, eos=eos)
    cfg = method_config(
        tmp_path,
        reward_model=True,
        max_steps=24,
        learning_rate=1e-2,
        **{**LORA, "lora_target_modules": ["q_proj", "v_proj"]},
    )
    trainer = preference_trainer(cfg, train)
    model = trainer.model
    head_before = model.get_base_model().score.modules_to_save["default"].weight.detach().clone()
    trainer.train()
    assert ranking_accuracy(trainer.model, held_out) >= 0.9
    head_after = model.get_base_model().score.modules_to_save["default"].weight
    assert not torch.equal(head_before, head_after)

    out = tmp_path / "reward-lora"
    trainer.save_model(str(out))
    saved = load_file(out / "adapter_model.safetensors")
    assert any("score" in name for name in saved), sorted(saved)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out)
    rows = list(held_out)
    torch.testing.assert_close(
        reward_scores(loaded, rows, "chosen_ids"), reward_scores(trainer.model, rows, "chosen_ids")
    )


def test_reward_model_refuses_an_adapter_that_leaves_the_head_untrained(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    from hellbender.errors import ConfigError
    from hellbender.train.methods.reward_model import check_score_head_trained

    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    with pytest.raises(ConfigError, match="score head"):
        check_score_head_trained(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])))


def test_weights_drawn_at_loading_do_not_depend_on_the_rng_before(tmp_path):
    """A reward model's score head is not in the checkpoint and is drawn while loading: the same config gives the
    same head whatever was drawn from the RNG before (data preparation draws a varying amount)."""
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.stack import build_trainable_model

    cfg = method_config(tmp_path, reward_model=True, **LORA)
    tokenizer, _ = load_tokenizer_and_processor(cfg)
    heads = []
    for draws in (1, 1000):
        torch.rand(draws)
        model = build_trainable_model(cfg, tokenizer)
        heads.append(model.get_base_model().score.modules_to_save["default"].weight.detach().clone())
    torch.testing.assert_close(heads[0], heads[1], rtol=0, atol=0)
