"""The memory planner under knowledge distillation: the teacher's weights are the bytes training loads, its forward
and FLOPs are planned beside the student's, the chunked loss (`kd_fused_loss`) holds less than the whole logits,
stored targets are counted, and `auto` and `gpu_memory_limit` treat distillation as a modelled method."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.plan.budget import plan_for, refuse_what_does_not_fit
from hellbender.plan.distillation import TARGET_SLOT_BYTES
from hellbender.plan.flops import TEACHER_FORWARD, step_flops_parts
from hellbender.plan.method import KD_CHUNKED, KD_LOGITS, STORED_TARGETS, TEACHER_MODEL
from hellbender.plan.model_facts import describe, meta_model
from hellbender.plan.report import render
from hellbender.plan.settings import plan_settings
from tests.helpers import CHAT_DATA, base_config
from tests.test_plan_methods import planned

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")


def model_dir(root: Path, name: str, weights: bool = True, **shape) -> Path:
    """A Llama of the tiny tokenizer with `shape` over the tiny decoder's; `weights: False` writes its config only
    (the planner reads nothing else), so a large vocabulary costs nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hellbender.models.tiny import build_tiny_tokenizer, tiny_decoder_config

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(**{**tiny_decoder_config(tokenizer), **shape})
    target = root / name
    if weights:
        LlamaForCausalLM(config).save_pretrained(target)
    else:
        config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def online(tmp_path: Path, teacher: Path | str = "hellbender/tiny-llama", **overrides) -> dict:
    settings = dict(kd_trainer=True, kd_teacher_model=str(teacher), kd_online_topk=16)
    return base_config(tmp_path, **{**settings, **overrides})


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_teacher_weights_are_the_bytes_of_the_teacher_training_loads(tmp_path, bf16):
    """A teacher wider and deeper than the student, with untied embeddings: the planned teacher weights equal the
    parameter bytes of the model `load_teacher` loads, to the byte, in the run's dtype."""
    from hellbender.models.loading import load_tokenizer
    from hellbender.train.teacher import load_teacher

    teacher_dir = model_dir(tmp_path, "teacher", hidden_size=96, intermediate_size=256, num_hidden_layers=3)
    cfg = validate_config(online(tmp_path, teacher_dir, bf16=bf16))
    teacher = load_teacher(cfg, load_tokenizer(cfg)).model
    loaded = sum(p.numel() * p.element_size() for p in teacher.parameters())
    facts, settings, memory = planned(cfg)
    assert settings.method.teacher == TEACHER_MODEL
    assert memory.teacher_weights == loaded
    student = sum(p.nbytes for p in facts.parameters)
    assert loaded > student  # the teacher's own shape, not the student's
    assert memory.phases["teacher forward"] > memory.teacher_weights + memory.weights + memory.optimizer_states


def test_the_report_plans_distillation_and_names_the_teacher_parts(tmp_path):
    cfg = validate_config(online(tmp_path, kd_ce_alpha=0.5))
    plan = plan_for(cfg, gpu="H100")
    text = render(plan)
    assert "NOT MODELLED" not in text and "is not modelled" not in text, text
    for needle in (
        "knowledge distillation, micro-batch 4 x 128 tokens, teacher hellbender/tiny-llama",
        "teacher weights (frozen)",
        "teacher forward (no gradients, before the student's)",
        "teacher's top-16 targets (ids, log-probabilities, mask)",
        "distillation loss, a chunk of positions at a time",  # the GPU default
        "teacher forward (no gradients) 0.",  # its FLOPs beside the policy's
    ):
        assert needle in text, text
    assert "teacher forward" in plan.memory.phases


def test_the_teacher_forward_flops_are_its_linear_layers_head_and_attention_over_every_token(tmp_path):
    teacher_dir = model_dir(tmp_path, "teacher", hidden_size=96, intermediate_size=256, num_hidden_layers=3)
    cfg = validate_config(online(tmp_path, teacher_dir, sequence_len=64))
    facts, settings, _ = planned(cfg)
    teacher, tokens = facts.teacher, settings.tokens
    attention = teacher.layers * 4 * tokens * (64 / 2) * teacher.q_dim
    expected = 2 * tokens * (teacher.decoder_linear_numel + teacher.head_numel) + attention
    parts = step_flops_parts(facts, settings)
    assert parts[TEACHER_FORWARD] == pytest.approx(expected, rel=1e-12)
    supervised = validate_config(base_config(tmp_path, sequence_len=64))
    sft_facts = describe(supervised, meta_model(supervised))
    assert step_flops_parts(sft_facts, plan_settings(supervised, facts=sft_facts)) == {
        name: value for name, value in parts.items() if name != TEACHER_FORWARD
    }  # the student's own work is supervised training's of the same rows


def test_the_chunked_loss_holds_less_than_the_whole_logits(tmp_path):
    """A 32,768-token vocabulary (config only): the whole-logits loss holds 18 bytes per logit in bf16 with
    `kd_ce_alpha` > 0 and 16 without (as measured on CPU, plan/distillation.py); the chunked loss and the teacher's
    chunked top-k hold one chunk's, which lowers the peak."""
    big = model_dir(tmp_path, "big-vocab", weights=False, vocab_size=32768)
    common = dict(base_model=str(big), bf16=True, sequence_len=2048, kd_ce_alpha=0.1)
    whole_cfg = validate_config(online(tmp_path, big, kd_fused_loss=False, **common))
    chunked_cfg = validate_config(online(tmp_path, big, kd_fused_loss=True, **common))
    facts, whole_settings, whole = planned(whole_cfg)
    _, chunked_settings, chunked = planned(chunked_cfg)
    assert (whole_settings.method.head, chunked_settings.method.head) == (KD_LOGITS, KD_CHUNKED)
    logits = whole_settings.tokens * facts.vocab
    assert whole.loss == 18 * logits
    assert chunked.loss < 0.6 * whole.loss  # 8,192 positions, 4,096 per chunk
    assert chunked.teacher_forward < whole.teacher_forward
    assert chunked.peak < whole.peak

    _, _, without_ce = planned(
        validate_config(online(tmp_path, big, kd_fused_loss=False, **{**common, "kd_ce_alpha": 0}))
    )
    assert without_ce.loss == 16 * logits

    # Unset, as training decides on a GPU: chunked, unless the config rules it out (an adapter on `lm_head`).
    _, default, _ = planned(validate_config(online(tmp_path, big, **common)))
    lora = dict(adapter="lora", lora_target_linear=True, lora_modules_to_save=["lm_head"])
    _, on_head, _ = planned(validate_config(online(tmp_path, big, **common, **lora)))
    assert (default.method.head, on_head.method.head) == (KD_CHUNKED, KD_LOGITS)


def test_the_smallest_change_that_fits_is_the_chunked_loss(tmp_path):
    big = model_dir(tmp_path, "big-vocab", weights=False, vocab_size=32768)
    cfg = validate_config(online(tmp_path, big, base_model=str(big), bf16=True, sequence_len=2048, kd_fused_loss=False))
    whole = plan_for(cfg, gpu="H100")
    chunked = plan_for(
        validate_config(online(tmp_path, big, base_model=str(big), bf16=True, sequence_len=2048)), "H100"
    )
    between = (whole.memory.needed + chunked.memory.needed) / 2 / 1024**3
    text = render(plan_for(cfg, gpu="H100", gpu_memory=between))
    assert "smallest change that fits: `kd_fused_loss: true`" in text, text
    assert "liger_fused_linear_cross_entropy" not in text  # distillation refuses Liger's loss


def test_stored_targets_are_counted_without_a_teacher_model(tmp_path):
    entry = {"path": CHAT_DATA, "type": "chat_template", "logprobs_field": "logprobs"}
    cfg = validate_config(base_config(tmp_path, kd_trainer=True, datasets=[entry]))
    facts, settings, memory = planned(cfg)
    assert settings.method.teacher == STORED_TARGETS and facts.teacher is None
    assert memory.teacher_weights == memory.teacher_forward == 0 and "teacher forward" not in memory.phases
    assert memory.teacher_targets == 2 * settings.tokens * 64 * TARGET_SLOT_BYTES
    text = render(plan_for(cfg, gpu="H100"))
    assert "the teacher's top 64 per token stored with the rows" in text and "NOT MODELLED" not in text
    assert "teacher's top-64 targets" in text and "planned as 64" in text
    assert TEACHER_FORWARD not in text


def test_auto_and_the_memory_limit_plan_distillation_as_modelled(tmp_path, caplog):
    from hellbender.config import validate_config as validate_with
    from hellbender.plan.auto import choose

    chosen = validate_with({**online(tmp_path), "micro_batch_size": "auto"}, choose)
    assert isinstance(chosen.micro_batch_size, int)

    with caplog.at_level(logging.WARNING, logger="hellbender"):
        assert refuse_what_does_not_fit(validate_config(online(tmp_path, gpu_memory_limit="60GiB"))) is not None
    assert "does not model" not in caplog.text
    needed = plan_for(validate_config(online(tmp_path)), gpu="H100").memory.needed / 1024**3
    with pytest.raises(ConfigError) as refused:
        refuse_what_does_not_fit(validate_config(online(tmp_path, gpu_memory_limit=f"{needed - 0.001:.4f}GiB")))
    assert f"predicted to need {needed:.1f} GiB per GPU (peak" in str(refused.value)
    assert "as supervised training" not in str(refused.value)


@pytest.mark.parametrize(
    ("fused", "measured_seconds"), [(False, 0.490), (True, 0.488)], ids=["whole-logits", "chunked"]
)
def test_the_h200_distillation_runs_are_planned_within_ten_percent_of_their_step(tmp_path, fused, measured_seconds):
    """docs/benchmarks.md's online distillation runs (W2's 1B student, full fine-tuning, every layer checkpointed,
    from W1's 8B shape, top 64, `kd_ce_alpha` 0.1; one H200): planned at 0.92 and 0.94 of their measured step since
    the loss is priced by its own per-logit cost, where pricing it as a cross-entropy planned 0.86."""
    from tests.test_plan_kernel_costs import W2_SHAPE

    teacher = model_dir(tmp_path, "llama3-8b", weights=False, hidden_size=4096, num_hidden_layers=32,
                        intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
    raw = online(tmp_path, teacher, adapter=None, sequence_len=2048, micro_batch_size=4, gradient_checkpointing=True,
                 bf16=True, kd_online_topk=64, kd_alpha=0.9, kd_ce_alpha=0.1, kd_fused_loss=fused,
                 overrides_of_model_config=W2_SHAPE)  # fmt: skip
    planned_seconds = plan_for(validate_config(raw), gpu="H200").time.seconds
    assert 0.9 < planned_seconds / measured_seconds < 1.0
