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
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainingArguments

from hellbender.train.methods.kto import build_kto_trainer
from hellbender.train.methods.orpo import build_orpo_trainer
from hellbender.train.methods.reward_model import build_reward_trainer
from hellbender.train.methods.rows import legacy_pair_columns
from hellbender.train.methods.simpo import build_simpo_trainer
from hellbender.train.methods.trl_config import trl_config

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


def arguments(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_steps=40,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def causal_lm(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config)


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


# --- the shared configuration copy ------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["kto", "orpo", "cpo", "reward"])
def test_trl_config_keeps_every_training_argument(tmp_path, config):
    from trl import KTOConfig, RewardConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    config_class = {"kto": KTOConfig, "orpo": ORPOConfig, "cpo": CPOConfig, "reward": RewardConfig}[config]
    args = arguments(tmp_path, learning_rate=2e-3, logging_steps=3, gradient_accumulation_steps=2, warmup_steps=5)
    copied = trl_config(config_class, args, disable_dropout=False)
    assert type(copied) is config_class
    given, copy = args.to_dict(), copied.to_dict()
    assert {name: copy[name] for name in given} == given
    # TRL's own defaults (checkpointing and bf16 on, learning rate 1e-6, logging every 10 steps) do not apply.
    assert (copied.gradient_checkpointing, copied.bf16, copied.learning_rate, copied.logging_steps) == (
        False,
        False,
        2e-3,
        3,
    )
    assert copied.disable_dropout is False
    with pytest.raises(TypeError, match="no field"):
        trl_config(config_class, args, not_a_field=1)


# --- KTO -----------------------------------------------------------------------------------------------------------


def test_kto_step_zero_has_no_kl_and_no_rewards(tmp_path, tiny_model_path, tiny_tokenizer):
    """With the policy equal to the reference (a fresh adapter: the base with it disabled), the log-ratios are 0:
    KL, rewards and margins are exactly 0 and every row's loss is weight * (1 - sigmoid(0)) = weight / 2."""
    eos = tiny_tokenizer.eos_token_id
    data = unpaired_dataset(16, seed=0, eos=eos)
    model = with_lora(causal_lm(tiny_model_path))
    trainer = build_kto_trainer(
        model,
        arguments(tmp_path, max_steps=1),
        tiny_tokenizer,
        data,
        beta=0.1,
        desirable_weight=1.5,
        undesirable_weight=0.5,
    )
    assert set(trainer.model.peft_config) == {"default"}  # no second ("ref") adapter in memory
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    # Only the answer is scored: the completion mask covers exactly the answer tokens.
    for i in range(8):
        n_prompt, n_answer = len(data[i]["prompt_ids"]), len(data[i]["completion_ids"])
        assert (
            batch["input_ids"][i, : n_prompt + n_answer].tolist() == data[i]["prompt_ids"] + data[i]["completion_ids"]
        )
        assert batch["completion_mask"][i].tolist()[: n_prompt + n_answer] == [0] * n_prompt + [1] * n_answer
    labels = torch.tensor(data[:8]["label"])
    expected = torch.where(labels, 1.5, 0.5).mul(0.5).mean()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-7)

    trainer.train()
    first = trainer.state.log_history[0]
    assert first["kl"] == 0.0
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0 and first["rewards/margins"] == 0.0


def test_kto_full_fine_tuning_step_zero_with_a_reference_copy(tmp_path, tiny_model_path, tiny_tokenizer):
    data = unpaired_dataset(16, seed=0, eos=tiny_tokenizer.eos_token_id)
    trainer = build_kto_trainer(
        causal_lm(tiny_model_path),
        arguments(tmp_path, max_steps=1),
        tiny_tokenizer,
        data,
        ref_model=causal_lm(tiny_model_path),
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.0,
    )
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["kl"] == 0.0 and first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0


def test_kto_full_fine_tuning_refuses_to_load_its_own_reference(tmp_path, tiny_model_path, tiny_tokenizer):
    data = unpaired_dataset(8, seed=0, eos=tiny_tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="needs a reference model"):
        build_kto_trainer(
            causal_lm(tiny_model_path),
            arguments(tmp_path),
            tiny_tokenizer,
            data,
            beta=0.1,
            desirable_weight=1.0,
            undesirable_weight=1.0,
        )


def test_kto_learns_a_preference_from_unpaired_rows(tmp_path, tiny_model_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = unpaired_dataset(256, seed=1, eos=eos), paired_dataset(32, seed=2, eos=eos)
    model = causal_lm(tiny_model_path)
    before = preference_accuracy(model, held_out)
    trainer = build_kto_trainer(
        model,
        arguments(tmp_path, max_steps=20),
        tiny_tokenizer,
        train,
        ref_model=causal_lm(tiny_model_path),
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.0,
    )
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


def test_orpo_step_zero_loss_matches_a_hand_computation(tmp_path, tiny_model_path, tiny_tokenizer):
    data = paired_dataset(8, seed=3, eos=tiny_tokenizer.eos_token_id)
    trainer = build_orpo_trainer(causal_lm(tiny_model_path), arguments(tmp_path), tiny_tokenizer, data, orpo_alpha=0.25)
    rows = [data[i] for i in range(8)]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    mean_chosen, mean_rejected, nll = hand_terms(trainer.model, rows)
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    expected = nll - 0.25 * F.logsigmoid(log_odds).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert trainer._stored_metrics["train"]["nll_loss"][-1] == pytest.approx(nll.item(), rel=1e-5)


def test_orpo_learns_a_preference_without_a_reference_model(tmp_path, tiny_model_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=4, eos=eos), paired_dataset(32, seed=5, eos=eos)
    model = causal_lm(tiny_model_path)
    before = preference_accuracy(model, held_out)
    trainer = build_orpo_trainer(model, arguments(tmp_path, max_steps=12), tiny_tokenizer, train, orpo_alpha=0.1)
    assert not hasattr(trainer, "ref_model") or trainer.ref_model is None
    trainer.train()
    after = preference_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)
    margins = logged(trainer, "rewards/margins")
    assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5


def test_simpo_step_zero_loss_matches_a_hand_computation(tmp_path, tiny_model_path, tiny_tokenizer):
    data = paired_dataset(8, seed=6, eos=tiny_tokenizer.eos_token_id)
    beta, gamma, alpha = 2.0, 0.5, 0.3
    trainer = build_simpo_trainer(
        causal_lm(tiny_model_path),
        arguments(tmp_path),
        tiny_tokenizer,
        data,
        beta=beta,
        simpo_gamma=gamma,
        cpo_alpha=alpha,
    )
    rows = [data[i] for i in range(8)]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    mean_chosen, mean_rejected, nll = hand_terms(trainer.model, rows)
    expected = -F.logsigmoid(beta * (mean_chosen - mean_rejected) - gamma).mean() + alpha * nll
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_simpo_learns_a_preference(tmp_path, tiny_model_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=7, eos=eos), paired_dataset(32, seed=8, eos=eos)
    model = causal_lm(tiny_model_path)
    before = preference_accuracy(model, held_out)
    trainer = build_simpo_trainer(
        model, arguments(tmp_path, max_steps=12), tiny_tokenizer, train, beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0
    )
    trainer.train()
    after = preference_accuracy(trainer.model, held_out)
    assert 0.25 <= before <= 0.75
    assert after >= 0.9, (before, after)


# --- reward model --------------------------------------------------------------------------------------------------


def reward_model(path):
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)


def test_reward_model_ranks_held_out_pairs_and_loads_in_plain_transformers(tmp_path, tiny_model_path, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=9, eos=eos), paired_dataset(32, seed=10, eos=eos)
    model = reward_model(tiny_model_path)
    trainer = build_reward_trainer(model, arguments(tmp_path, max_steps=12), tiny_tokenizer, train)
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


def test_reward_model_with_lora_trains_and_saves_the_score_head(tmp_path, tiny_model_path, tiny_tokenizer):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    eos = tiny_tokenizer.eos_token_id
    train, held_out = paired_dataset(128, seed=11, eos=eos), paired_dataset(32, seed=12, eos=eos)
    config = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(reward_model(tiny_model_path), config)
    head_before = model.get_base_model().score.modules_to_save["default"].weight.detach().clone()
    trainer = build_reward_trainer(model, arguments(tmp_path, max_steps=16, learning_rate=1e-2), tiny_tokenizer, train)
    trainer.train()
    assert ranking_accuracy(trainer.model, held_out) >= 0.9
    head_after = model.get_base_model().score.modules_to_save["default"].weight
    assert not torch.equal(head_before, head_after)

    out = tmp_path / "reward-lora"
    trainer.save_model(str(out))
    saved = load_file(out / "adapter_model.safetensors")
    assert any("score" in name for name in saved), sorted(saved)
    loaded = PeftModel.from_pretrained(reward_model(tiny_model_path), out)
    rows = list(held_out)
    torch.testing.assert_close(
        reward_scores(loaded, rows, "chosen_ids"), reward_scores(trainer.model, rows, "chosen_ids")
    )


def test_reward_model_refuses_an_adapter_that_leaves_the_head_untrained(tmp_path, tiny_model_path, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(reward_model(tiny_model_path), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="score head"):
        build_reward_trainer(model, arguments(tmp_path), tiny_tokenizer, paired_dataset(8, 0, 0))
