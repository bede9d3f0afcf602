"""The chunked distillation loss (`kd_fused_loss`): the loss, both parts and every gradient equal the loss on the
model's whole logits, over several chunks, with a soft-capped and a tied output layer; the chunked teacher gives the
same top-k targets; a family that transforms its logits after the output layer is refused by name, as are configs
that rule the chunked loss out; a training run with it logs the same steps as one without."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from hellbender.config import validate_config
from hellbender.data.teacher_targets import TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK
from hellbender.errors import ConfigError
from hellbender.models import output_head
from hellbender.models.output_head import chunked_head
from hellbender.train.distillation_loss import DistillationLoss, distillation_loss
from hellbender.train.fused_distillation_loss import fused_distillation_loss
from hellbender.train.teacher import Teacher, per_token, topk_targets
from tests.conftest import write_jsonl
from tests.helpers import CHAT_DATA, base_config, trainer_state
from tests.test_distillation import kd_config, kd_rows

VOCAB = 97
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip
KEY = "kd_fused_loss"


def tiny(family: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False, **extra))
    if family == "gemma2":  # tied output layer, final logit soft-capping
        return Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=16, final_logit_softcapping=5.0, **extra))
    return GraniteForCausalLM(GraniteConfig(**SHAPE, logits_scaling=4.0, **extra))  # divides its logits by 4


def batch() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 14), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # prompts
    labels[1, :3] = -100
    labels[1, 9] = -100  # an untrained token inside the answer
    targets = per_token(topk_targets(torch.randn(2, 14, VOCAB, generator=g), 6, 2.0))
    targets[TARGET_MASK][0, 8] = False  # a trained token without a target
    targets[TARGET_MASK][1, 11, 4:] = False  # a position with four targets
    return ids, labels, [targets[key] for key in (TARGET_IDS, TARGET_LOGPROBS, TARGET_MASK)]


def chunked(student: torch.nn.Module, ids: torch.Tensor, labels, targets, settings, items) -> tuple:
    head = chunked_head(student, "the student", KEY, required=True)
    with head.capturing():
        last = student(input_ids=ids).logits
    assert last.shape == (2, 1, VOCAB)  # the model projected its last position only
    return fused_distillation_loss(head, head.hidden_states(), labels, *targets, settings, items)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize(
    "settings",
    [
        DistillationLoss(alpha=0.7, ce_alpha=0.3, temperature=2.0),
        DistillationLoss(alpha=1.0, ce_alpha=0.0, normalize_topk=True, beta=0.5),
        DistillationLoss(alpha=0.5, ce_alpha=0.5, zscore_base_temp=1.5, beta=1.0),
    ],
    ids=["forward-kl", "jensen-shannon-topk", "zscore-reverse"],
)
def test_the_chunked_loss_and_every_gradient_equal_the_loss_on_whole_logits(family, settings, monkeypatch):
    monkeypatch.setattr(output_head, "CHUNK_LOGITS", VOCAB * 4)  # 4 positions per chunk: 6 chunks of 21 positions
    whole = tiny(family)
    split = copy.deepcopy(whole)
    ids, labels, targets = batch()
    want = distillation_loss(whole(input_ids=ids).logits, labels, *targets, settings, num_items_in_batch=30)
    want.loss.backward()
    parts = chunked(split, ids, labels, targets, settings, torch.tensor(30))
    parts.loss.backward()
    for name in ("loss", "kd", "ce"):
        torch.testing.assert_close(getattr(parts, name), getattr(want, name), rtol=1e-5, atol=1e-6)
    assert float(want.kd) > 1e-3 and float(want.ce) > 1.0  # both parts are real sums
    grads = dict(whole.named_parameters())
    for name, parameter in split.named_parameters():  # the output layer's weight and everything below it
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    assert split.get_output_embeddings().weight.grad.abs().sum() > 0


def test_evaluation_without_gradients_gives_the_same_parts():
    student = tiny("llama")
    ids, labels, targets = batch()
    settings = DistillationLoss(alpha=0.7, ce_alpha=0.3)
    with torch.no_grad():
        want = distillation_loss(student(input_ids=ids).logits, labels, *targets, settings)
        got = chunked(student, ids, labels, targets, settings, None)  # divided by this batch's trained tokens
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.kd, want.kd)


def test_the_chunked_teacher_gives_the_same_top_k_targets(monkeypatch):
    monkeypatch.setattr(output_head, "CHUNK_LOGITS", VOCAB * 5)
    model = tiny("gemma2").eval()
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    whole = Teacher(model, top_k=7, temperature=2.0, vocab=90).targets(inputs)
    split = Teacher(model, top_k=7, temperature=2.0, vocab=90, chunked=True).targets(inputs)
    assert torch.equal(split[TARGET_IDS], whole[TARGET_IDS]) and int(split[TARGET_IDS].max()) < 90
    torch.testing.assert_close(split[TARGET_LOGPROBS], whole[TARGET_LOGPROBS])
    assert torch.equal(split[TARGET_MASK], whole[TARGET_MASK])


def test_a_family_that_scales_its_logits_is_refused_by_name_or_keeps_its_whole_logits(caplog):
    """Granite divides its logits by `logits_scaling` after the output layer: `kd_fused_loss: true` is refused by
    name before training; unset, the run keeps the whole logits and says so."""
    student = tiny("granite")
    with pytest.raises(ConfigError, match=r"`kd_fused_loss`: the student \(granite\) turns its last hidden states"):
        chunked_head(student, "the student", KEY, required=True)
    with caplog.at_level("INFO", logger="hellbender"):
        assert chunked_head(student, "the student", KEY, required=False) is None
    assert "kd_fused_loss: whole logits, not chunks (the student (granite) turns" in caplog.text
    assert not student.get_output_embeddings()._forward_pre_hooks  # nothing of the chunked path is left on it


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"fsdp_version": 2}, "FSDP2"),
        ({"deepspeed": "deepspeed_configs/zero3.json"}, "ZeRO-3 partitions"),
        ({"adapter": "lora", "lora_target_linear": True, "lora_modules_to_save": ["lm_head"]}, "wraps `lm_head`"),
    ],
)
def test_configs_that_rule_the_chunked_loss_out_are_refused(tmp_path, overrides, named):
    raw = base_config(tmp_path, kd_trainer=True, kd_teacher_model="t", kd_fused_loss=True, **overrides)
    with pytest.raises(ConfigError, match=f"`kd_fused_loss: true` cannot work here: .*{named}"):
        validate_config(raw)
    with pytest.raises(ConfigError, match="`kd_fused_loss` set but knowledge distillation is off"):
        validate_config(
            base_config(tmp_path, datasets=[{"path": CHAT_DATA, "type": "chat_template"}], kd_fused_loss=True)
        )


def test_a_run_with_the_chunked_loss_logs_the_steps_of_a_run_without(tmp_path, tiny_tokenizer, monkeypatch):
    """Full fine-tuning (the output layer trains too), packed rows, gradient accumulation, evaluation rows: per-step
    loss, KD and cross-entropy parts, the evaluation loss and the final weights agree."""
    from hellbender.train import distillation

    calls = []
    monkeypatch.setattr(
        distillation, "fused_distillation_loss", lambda *a, **k: calls.append(1) or fused_distillation_loss(*a, **k)
    )
    data = write_jsonl(tmp_path / "kd.jsonl", kd_rows(tiny_tokenizer, n=12))
    common = dict(
        kd_alpha=0.8, kd_ce_alpha=0.2, sample_packing=True, sequence_len=256, micro_batch_size=1,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, val_set_size=0.25, eval_steps=3,
    )  # fmt: skip
    runs = {}
    for fused in (False, True):
        from hellbender.train.run import train

        cfg = validate_config(kd_config(tmp_path / str(fused), data, kd_fused_loss=fused, **common))
        train(cfg)
        runs[fused] = cfg
    logs = {
        fused: [e for e in trainer_state(cfg.output_dir)["log_history"] if "loss" in e] for fused, cfg in runs.items()
    }
    assert [e["step"] for e in logs[True]] == [e["step"] for e in logs[False]] == [1, 2, 3]
    assert len(calls) > 6  # the fused run's 3 x 2 training micro-batches and its evaluation, none of the other run's
    evaluated = {
        fused: [e["eval_loss"] for e in trainer_state(cfg.output_dir)["log_history"] if "eval_loss" in e]
        for fused, cfg in runs.items()
    }
    assert len(evaluated[True]) == 1 and evaluated[True] == pytest.approx(evaluated[False], abs=1e-5), evaluated
    for got, want in zip(logs[True], logs[False], strict=True):
        for key in ("loss", "kd_loss", "ce_loss"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got, want)
    from safetensors.torch import load_file

    final = {fused: load_file(f"{cfg.output_dir}/model.safetensors") for fused, cfg in runs.items()}
    for name, value in final[False].items():
        torch.testing.assert_close(final[True][name], value, rtol=1e-4, atol=1e-6, msg=name)
