"""DPO on TRL's DPOTrainer, driven by hellbender's config and model: the reference model in each case, the loss at the
first step, learning a preference, and the config rules of the preference keys."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from hellbender.config.loading import validate_config
from tests.helpers import PREFERENCE_DATA, base_config, preference_trainer

# Token ids of the tiny tokenizer's byte-level vocabulary used to build pairs: a cue at the start of the prompt says
# which of two endings is preferred.
CUES = (70, 71)
ENDINGS = (80, 81)
FILLER = range(100, 160)


def preference_pairs(count: int, seed: int):
    """Pairs whose chosen answer ends with the ending the prompt's first token asks for, the rejected one with the
    other: learnable only from the prompt, and about half of the pairs prefer each ending."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for _ in range(count):
        cue = rng.randrange(2)
        body = [rng.choice(FILLER) for _ in range(2)]
        rows["prompt_ids"].append([CUES[cue], *(rng.choice(FILLER) for _ in range(4))])
        rows["chosen_ids"].append([*body, ENDINGS[cue]])
        rows["rejected_ids"].append([*body, ENDINGS[1 - cue]])
    return Dataset.from_dict(rows)


def dpo_config(tmp_path: Path, adapter: str | None = "lora", **overrides):
    settings = {
        "rl": "dpo",
        "micro_batch_size": 8,
        "datasets": [{"path": PREFERENCE_DATA, "type": "chat_template.default"}],
    }
    if adapter:
        settings.update(adapter=adapter, lora_r=8, lora_alpha=16)
    return validate_config(base_config(tmp_path, **{**settings, **overrides}))


def dpo_trainer(cfg, train_rows, eval_rows=None, callbacks=()):
    """The trainer `hellbender train` builds for `cfg`, on the given prepared pairs."""
    return preference_trainer(cfg, train_rows, eval_rows, callbacks)


def answer_log_probs(model, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the chosen and of the rejected answers under `model` as it is now."""
    sums = []
    with torch.no_grad():
        for key in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor([p + a for p, a in zip(rows["prompt_ids"], rows[key], strict=True)])
            logits = model(input_ids=ids).logits[:, :-1].float()
            token_logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            answer = len(rows[key][0])
            sums.append(token_logps[:, -answer:].sum(-1))
    return sums[0], sums[1]


def first_step_metrics(trainer):
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return loss, metrics


@pytest.mark.parametrize("adapter", ["lora", None])
def test_first_step_policy_equals_reference_loss_is_log_2(tmp_path, adapter):
    cfg = dpo_config(tmp_path, adapter=adapter)
    trainer = dpo_trainer(cfg, preference_pairs(16, seed=0))
    if adapter is None:
        assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    else:
        assert trainer.ref_model is None and "ref" not in trainer.model.peft_config  # the base, adapter off
    loss, metrics = first_step_metrics(trainer)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["rewards/chosen"] == 0.0 and metrics["rewards/rejected"] == 0.0
    assert metrics["rewards/margins"] == 0.0


def test_reference_log_probs_are_the_base_models_with_the_adapter_off(tmp_path):
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.stack import load_base_model

    cfg = dpo_config(tmp_path, max_steps=3, learning_rate=1e-2)
    rows = preference_pairs(24, seed=1)
    trainer = dpo_trainer(cfg, rows)
    trainer.train()
    batch = trainer.data_collator([rows[i] for i in range(8)])  # chosen rows first, then rejected
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    # After training the adapter has moved, so the reference differs from the policy ...
    policy_chosen, _ = answer_log_probs(trainer.model, rows[:8])
    assert not torch.equal(policy_chosen, ref_chosen)
    # ... and equals the untouched base model, bit for bit (scored with the same fused LM head TRL uses).
    from trl.trainer.utils import add_fused_lm_head

    tokenizer, _ = load_tokenizer_and_processor(cfg)
    base = load_base_model(cfg, tokenizer)
    add_fused_lm_head(base)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        scored = base(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, fused_lm_head=True
        )
    base_chosen, base_rejected = scored.log_probs.sum(dim=1).chunk(2)
    torch.testing.assert_close(ref_chosen, base_chosen, rtol=0, atol=0)
    torch.testing.assert_close(ref_rejected, base_rejected, rtol=0, atol=0)


def test_a_tiny_model_learns_a_preference_on_held_out_pairs(tmp_path):
    cfg = dpo_config(tmp_path, max_steps=16, learning_rate=2e-2, rl_beta=0.5, micro_batch_size=16)
    held_out = preference_pairs(64, seed=99)
    trainer = dpo_trainer(cfg, preference_pairs(128, seed=2))
    chosen, rejected = answer_log_probs(trainer.model, held_out)
    accuracy_before, margin_before = (chosen > rejected).float().mean().item(), (chosen - rejected).mean().item()
    trainer.train()
    chosen, rejected = answer_log_probs(trainer.model, held_out)
    accuracy_after, margin_after = (chosen > rejected).float().mean().item(), (chosen - rejected).mean().item()
    assert 0.3 <= accuracy_before <= 0.7
    assert accuracy_after >= 0.9
    assert margin_after > margin_before + 1.0
    logged = [e for e in trainer.state.log_history if "rewards/margins" in e]
    assert logged[-1]["rewards/margins"] > logged[0]["rewards/margins"]
    assert logged[-1]["rewards/accuracies"] >= 0.9
    from hellbender.train.plots import report_plots

    plots = report_plots(trainer.state.log_history, "off")  # the run report draws the DPO metrics per step
    assert isinstance(plots["rewards.png"], bytes) and isinstance(plots["preference_accuracy.png"], bytes)


def test_rpo_alpha_adds_the_sft_loss_with_its_weight(tmp_path):
    from hellbender.train.methods.dpo import arguments

    def dpo_arguments(cfg):
        return arguments(cfg)[1]

    args = dpo_arguments(dpo_config(tmp_path, rpo_alpha=0.5, dpo_beta=0.3))
    assert args["loss_type"] == ["sigmoid", "sft"] and args["loss_weights"] == [1.0, 0.5]
    assert args["beta"] == 0.3 and args["activation_checkpointing"] is False
    ipo = dpo_arguments(dpo_config(tmp_path, rl="ipo"))
    assert ipo["loss_type"] == ["ipo"] and ipo["beta"] == 0.1
    assert dpo_arguments(dpo_config(tmp_path, dpo_norm_loss=True))["loss_type"] == ["sigmoid_norm"]


def test_the_loss_types_offered_are_those_trl_computes():
    from typing import get_args

    from trl import DPOConfig

    from hellbender.config.preference import DpoLossType

    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    named = set(__import__("re").findall(r"`'([a-z_]+)'`", help_text))
    assert set(get_args(DpoLossType)) == named


def test_the_installed_trl_has_no_liger_preference_loss_to_switch_on():
    """`dpo_use_liger_kernel` is refused because TRL has no Liger loss for its preference trainers (its
    `use_liger_kernel` patches layers only). A TRL that offers one again fails here: then the key can be bound."""
    from dataclasses import fields

    from trl import DPOConfig, KTOConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    for config in (DPOConfig, KTOConfig, CPOConfig, ORPOConfig):
        liger = {f.name for f in fields(config) if "liger" in f.name}
        assert liger == {"use_liger_kernel", "liger_kernel_config"}, (config.__name__, liger)
        assert "layers" in config.__dataclass_fields__["use_liger_kernel"].metadata["help"]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"rl": "ebft"}, ["rl: ebft", "does not offer yet"]),
        ({"center_rewards_coefficient": 0.01}, ["center_rewards_coefficient", "reward_model` is not set"]),
        ({"rl": "kto", "micro_batch_size": 1}, ["rl: kto", "micro_batch_size: 1", "at least 2"]),
        ({"reward_model": True, "model_type": "AutoModelForCausalLM"}, ["reward_model", "model_type"]),
        ({"rl": "dpo", "orpo_alpha": 0.1}, ["orpo_alpha", "rl: orpo", "rl: dpo"]),
        ({"kto_desirable_weight": 1.0}, ["kto_desirable_weight", "rl: kto", "`rl` is not set"]),
        ({"rl": "dpo", "reward_model": True}, ["reward_model", "rl: dpo"]),
        ({"rl": "dpo", "dpo_label_smoothing": 0.1}, ["dpo_label_smoothing", "robust"]),
        ({"rl": "ipo", "dpo_loss_type": ["sigmoid"]}, ["dpo_loss_type", "rl: ipo"]),
        ({"rl": "dpo", "sample_packing": True}, ["sample_packing", "rl: dpo"]),
        ({"rl": "dpo", "dpo_use_liger_kernel": True}, ["dpo_use_liger_kernel", "TRL 1.16", "fused LM head"]),
    ],
)
def test_preference_config_errors_name_the_key(tmp_path, overrides, needles):
    from hellbender.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        validate_config(base_config(tmp_path, **overrides))
    for needle in needles:
        assert needle in str(error.value)
