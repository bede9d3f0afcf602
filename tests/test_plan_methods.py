"""The memory planner under preference tuning, reward models, online RL and distillation: the rows each method runs
per micro-batch, the reference model's copy and forward, the step's FLOPs, and the method it names as not modelled
(online RL) instead of planning it silently as supervised fine-tuning. Distillation's own parts are
tests/test_plan_distillation.py's."""

from __future__ import annotations

import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.errors import ConfigError
from hellbender.plan.activations import layer_bytes_per_token
from hellbender.plan.budget import plan_for, refuse_what_does_not_fit
from hellbender.plan.fit import element_size
from hellbender.plan.flops import step_flops, step_flops_parts
from hellbender.plan.memory import plan_memory
from hellbender.plan.model_facts import describe, meta_model
from hellbender.plan.report import render
from hellbender.plan.settings import plan_settings
from tests.helpers import PREFERENCE_DATA, base_config, invoke

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")


def pairs_config(tmp_path, **overrides) -> dict:
    """A preference run of the tiny Llama on the bundled pairs (`rl: dpo` unless overridden)."""
    settings = dict(rl="dpo", datasets=[{"path": PREFERENCE_DATA, "type": "chat_template.default"}])
    return base_config(tmp_path, **{**settings, **overrides})


def planned(cfg):
    facts = describe(cfg, meta_model(cfg))
    settings = plan_settings(cfg, facts=facts)
    return facts, settings, plan_memory(facts, settings, element_size(cfg))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_full_fine_tuning_reference_copy_is_the_bytes_of_the_copy_training_makes(tmp_path, bf16):
    from hellbender.models.loading import load_tokenizer
    from hellbender.models.stack import build_trainable_model
    from hellbender.train.methods.shared import reference_model

    cfg = validate_config(pairs_config(tmp_path, adapter=None, bf16=bf16))
    model = build_trainable_model(cfg, load_tokenizer(cfg))
    reference = reference_model(cfg, model)
    copied = sum(p.numel() * p.element_size() for p in reference.parameters())
    _, settings, memory = planned(cfg)
    assert settings.method.reference == "frozen copy"
    assert memory.reference_copy == copied == sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory.reference_forward > 0

    precomputed = validate_config(pairs_config(tmp_path, adapter=None, bf16=bf16, precompute_ref_log_probs=True))
    assert reference_model(precomputed, model) is None
    _, _, memory = planned(precomputed)
    assert memory.reference_copy == 0 and memory.reference_forward == 0  # scored once before training


def test_with_an_adapter_the_reference_is_the_base_without_a_copy(tmp_path):
    cfg = validate_config(pairs_config(tmp_path, adapter="lora", lora_target_linear=True))
    _, settings, memory = planned(cfg)
    assert settings.method.reference == "adapter off"
    assert memory.reference_copy == 0 and memory.reference_forward > 0


def test_dpo_tokens_per_micro_batch_in_both_layouts(tmp_path):
    """B pairs of a P-token prompt and two A-token answers: 2B rows of P + A tokens, or B shared rows of P + 2A + 1
    tokens, exactly as `share_prompts` builds them from TRL's rows."""
    from hellbender.train.shared_prompt import share_prompts

    pairs, sequence_len, prompt = 3, 64, 16
    answer = sequence_len - prompt
    common = dict(micro_batch_size=pairs, sequence_len=sequence_len, max_prompt_len=prompt)

    _, two_rows, _ = planned(validate_config(pairs_config(tmp_path, dpo_shared_prompt=False, **common)))
    assert (two_rows.rows, two_rows.row_len, two_rows.tokens) == (2 * pairs, sequence_len, 2 * pairs * sequence_len)

    _, shared, _ = planned(validate_config(pairs_config(tmp_path, dpo_shared_prompt=True, **common)))
    assert (shared.rows, shared.row_len) == (pairs, prompt + 2 * answer + 1)
    assert shared.tokens == pairs * (prompt + 2 * answer + 1) < two_rows.tokens

    trl_rows = torch.randint(5, 200, (2 * pairs, sequence_len))
    trl_rows[pairs:, :prompt] = trl_rows[:pairs, :prompt]  # each pair's two rows hold the same prompt
    labels = trl_rows.clone()
    labels[:, :prompt] = -100
    built = share_prompts(trl_rows, labels, torch.ones_like(trl_rows))
    assert tuple(built.input_ids.shape) == (shared.rows, shared.row_len)
    # The fused head projects the answer tokens only, the same in both layouts.
    assert shared.scored_tokens == two_rows.scored_tokens == int((built.labels != -100).sum()) == 2 * pairs * answer

    # A shared row goes through the varlen kernel with its key-value heads expanded to every query head, saved so.
    cfg = validate_config(pairs_config(tmp_path, **common))
    facts = describe(cfg, meta_model(cfg))
    assert facts.kv_dim < facts.q_dim  # the tiny Llama groups its query heads
    expanded = layer_bytes_per_token(facts, shared, 4, True) - layer_bytes_per_token(facts, two_rows, 4, True)
    assert expanded == 2 * 4 * (facts.q_dim - facts.kv_dim)

    # Unset, training shares where it pays on a GPU: SDPA in 16-bit precision yes; eager attention or float32 no.
    _, default, _ = planned(validate_config(pairs_config(tmp_path, bf16=True, **common)))
    _, eager, _ = planned(validate_config(pairs_config(tmp_path, bf16=True, attn_implementation="eager", **common)))
    _, fp32, _ = planned(validate_config(pairs_config(tmp_path, **common)))
    assert default.method.shared_prompt and not eager.method.shared_prompt and not fp32.method.shared_prompt


def test_dpo_flops_are_sft_of_the_same_rows_plus_the_reference_forward(tmp_path):
    """With the same 2B rows, DPO's step is supervised training's with the head's full-logits projection of all T
    tokens (2 T H forward, 2 T H backward) replaced by the fused head's of the N answer tokens (2 N H forward, 4 N H
    backward), plus the reference forward: 2 T D through the base decoder, 2 N H through the head, and attention."""
    pairs, sequence_len = 2, 64
    lora = dict(adapter="lora", lora_target_linear=True, sequence_len=sequence_len)
    dpo = validate_config(pairs_config(tmp_path, micro_batch_size=pairs, dpo_shared_prompt=False, **lora))
    sft = validate_config(base_config(tmp_path, micro_batch_size=2 * pairs, **lora))
    facts, dpo_settings, _ = planned(dpo)
    _, sft_settings, _ = planned(sft)
    assert dpo_settings.tokens == sft_settings.tokens
    tokens, answers = dpo_settings.tokens, dpo_settings.scored_tokens
    decoder, head = facts.decoder_linear_numel, facts.head_numel
    attention = facts.layers * 4 * tokens * (sequence_len / 2) * facts.q_dim
    reference = 2 * tokens * decoder + 2 * answers * head + attention
    expected = step_flops(facts, sft_settings) - 4 * tokens * head + 6 * answers * head + reference
    assert step_flops(facts, dpo_settings) == pytest.approx(expected, rel=1e-12)
    assert step_flops_parts(facts, dpo_settings)["reference forward"] == pytest.approx(reference, rel=1e-12)
    assert step_flops(facts, dpo_settings) / step_flops(facts, sft_settings) == pytest.approx(
        expected / step_flops(facts, sft_settings), rel=1e-12
    )


def _kd(tmp_path) -> dict:
    return base_config(tmp_path, kd_trainer=True, kd_teacher_model="hellbender/tiny-llama", kd_online_topk=16)


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (
            lambda p: pairs_config(p, adapter="lora", lora_target_linear=True),
            ["DPO", "reference: the base with the adapter off", "reference forward (no gradients)", "fused LM head"],
        ),
        (
            lambda p: pairs_config(p, adapter=None),
            ["reference: a frozen copy", "reference copy (frozen starting weights)", "reference forward 0."],
        ),
        (
            lambda p: pairs_config(p, adapter=None, precompute_ref_log_probs=True),
            ["reference log-probabilities precomputed"],
        ),
        (lambda p: pairs_config(p, rl="ipo"), ["IPO", "reference forward (no gradients)"]),
        (
            lambda p: pairs_config(p, rl="kto", datasets=[{"path": PREFERENCE_DATA, "type": "chatml.intel"}]),
            ["KTO", "4 KL rows", "KL rows (policy, no gradients)", "reference forward (no gradients)"],
        ),
        (
            lambda p: pairs_config(p, rl="orpo"),
            ["ORPO", "no reference model", "8 rows of 128 tokens", "logits and loss of 8 rows", "pairs/s"],
        ),
        (lambda p: pairs_config(p, rl="simpo"), ["SimPO", "no reference model", "logits and loss of 8 rows"]),
        (
            lambda p: pairs_config(p, rl=None, reward_model=True),
            ["reward model", "8 rows of 128 tokens", "score head (one score per token, no vocabulary logits)"],
        ),
        (
            _kd,
            [
                "knowledge distillation",
                "teacher weights (frozen)",
                "teacher forward (no gradients, before the student's)",
                "teacher's top-16 targets",
                "distillation loss",
            ],
        ),
    ],  # fmt: skip
    ids=["dpo-lora", "dpo-full", "dpo-precomputed", "ipo", "kto", "orpo", "simpo", "reward-model", "distillation"],
)
def test_each_method_names_what_it_adds(tmp_path, make, needles):
    text = render(plan_for(validate_config(make(tmp_path)), gpu="H100"))
    for needle in needles:
        assert needle in text, text
    assert ("reference copy" in text) == ("frozen copy" in text)
    assert "NOT MODELLED" not in text and "is not modelled" not in text


def grpo_plan(tmp_path, trl: dict | None = None, **overrides):
    from tests.test_grpo import grpo_config

    tmp_path.mkdir(parents=True, exist_ok=True)
    return plan_for(grpo_config(tmp_path, trl, **overrides), gpu="H100")


@pytest.mark.parametrize("base_model", ["hellbender/tiny-llama", "hellbender/tiny-gemma4"])
def test_the_planned_key_value_cache_is_the_one_generate_fills(tmp_path, base_model):
    """The rollout's key-value cache as planned is, to the byte, the static cache `generate` allocates for the same
    rows: every position but the last token's, sliding-window layers (Gemma 4) holding their window, layers that
    read another layer's keys and values holding none."""
    from hellbender.models.loading import load_tokenizer
    from hellbender.models.stack import build_trainable_model
    from tests.test_grpo import grpo_config

    rows, prompt, new = 3, 40, 24
    trl = {"num_generations": 3, "max_completion_length": new}
    cfg = grpo_config(tmp_path, trl, base_model=base_model, sequence_len=prompt + new, micro_batch_size=rows)
    planned = plan_for(cfg, gpu="H100").memory.rollout
    assert (planned.rows, planned.positions) == (rows, prompt + new - 1)

    model = build_trainable_model(cfg, load_tokenizer(cfg)).eval()
    ids = torch.randint(3, 200, (rows, prompt))
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        cache_implementation="static", disable_compile=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    assert out.sequences.shape[1] == prompt + new
    cached = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values) if t is not None]
    assert planned.kv_cache == sum(t.numel() * t.element_size() for t in cached) > 0


def test_grpo_plans_the_generation_of_its_completions_beside_training(tmp_path):
    """GRPO: each micro-batch trains B completions as rows of prompt + completion through TRL's fused head; between
    optimizer steps the model generates every completion of the next step at once, a moment of its own with their
    key-value cache, and its time joins the step's."""
    plan = grpo_plan(tmp_path, {"max_completion_length": 96}, sequence_len=128, gradient_accumulation_steps=2)
    s, m, t = plan.settings, plan.memory, plan.time
    assert (s.rows, s.row_len, s.scored_tokens) == (8, 128, 8 * 96)
    assert (m.rollout.rows, m.rollout.positions) == (16, 127)
    assert m.phases["generation"] == m.weights + m.adapter + m.optimizer_states + m.rollout.total
    assert m.reference_forward == 0 and "scoring the rollout" not in m.phases  # beta 0: no reference
    assert t.rollout.decode_steps == 95 and t.rollout.seconds > 0
    assert t.examples_per_second == pytest.approx(16 / t.seconds)
    text = render(plan)
    assert "GRPO, micro-batch 8 completions: 8 rows of 128 tokens (a 32-token prompt" in text
    assert "generation every step: 16 completions (4 prompts x 4), compiled decoding" in text
    assert "generation: key-value cache (16 rows x 127 positions)" in text and "completions/s" in text
    assert "NOT MODELLED" not in text and "`sequence_len` is not set" not in text


def test_without_sequence_len_the_report_says_where_the_planned_prompt_came_from(tmp_path):
    from hellbender.config import validate_config as validate_with
    from tests.test_grpo import grpo_settings

    raw = grpo_settings(tmp_path, {"reward_funcs_dir": str(tmp_path), "max_completion_length": 48})
    del raw["sequence_len"]
    text = render(plan_for(validate_with(raw), gpu="H100"))
    assert "`sequence_len` is not set, so prompts are planned at 2,000 tokens" in text


def test_a_longer_completion_raises_the_generation_and_not_training(tmp_path):
    """The cache grows with the positions generated; the rows trained are `sequence_len` either way."""
    short = grpo_plan(tmp_path / "short", {"max_completion_length": 32}, sequence_len=128)
    long = grpo_plan(tmp_path / "long", {"max_completion_length": 96}, sequence_len=128)
    assert long.memory.rollout.kv_cache == short.memory.rollout.kv_cache  # both 127 positions per row
    longer = grpo_plan(tmp_path / "longer", {"max_completion_length": 96}, sequence_len=256)
    assert longer.memory.rollout.kv_cache == pytest.approx(long.memory.rollout.kv_cache * 255 / 127)
    assert long.time.rollout.decode_steps == 3 * short.time.rollout.decode_steps + 2


def test_grpo_scores_its_rollout_with_the_reference_and_old_log_probabilities_once_per_generation(tmp_path):
    """`trl.beta` > 0 adds the reference's forward over the rollout (the base with the adapter off), several
    `trl.num_iterations` the policy's old log-probabilities; both, and the generation, once every
    `num_iterations` steps, before any training activations exist."""
    plain = grpo_plan(tmp_path / "plain", adapter="lora", lora_target_linear=True)
    beta = grpo_plan(tmp_path / "beta", {"beta": 0.04}, adapter="lora", lora_target_linear=True)
    assert beta.settings.method.reference == "adapter off" and beta.memory.reference_copy == 0
    fixed = beta.memory.weights + beta.memory.adapter + beta.memory.optimizer_states
    assert beta.memory.phases["scoring the rollout"] == fixed + beta.memory.reference_forward > fixed
    assert beta.memory.phases["loss"] == plain.memory.phases["loss"]  # not stacked on the policy's activations
    assert beta.time.parts["reference forward"] > 0 and "scoring the rollout (reference; no gradients)" in render(beta)

    twice = grpo_plan(tmp_path / "twice", {"beta": 0.04, "num_iterations": 2}, adapter="lora", lora_target_linear=True)
    assert twice.time.parts["reference forward"] == pytest.approx(beta.time.parts["reference forward"] / 2)
    assert twice.time.parts["old log-probabilities (policy, no gradients)"] > 0
    assert twice.time.rollout.seconds == pytest.approx(beta.time.rollout.seconds)
    assert "once every 2 steps" in render(twice) and "generation every 2 steps" in render(twice)

    full = grpo_plan(tmp_path / "full", {"beta": 0.04}, adapter=None)
    assert full.memory.reference_copy > 0  # a frozen copy of the starting weights


def test_a_grpo_run_whose_generation_does_not_fit_says_what_lowers_it(tmp_path):
    """When the generation's cache sets the peak, a smaller micro-batch does not help (the same completions are
    generated at once): the refusal names what does."""
    from tests.test_grpo import grpo_config

    keys = dict(sequence_len=1024, micro_batch_size=4, gradient_accumulation_steps=64)
    plan = grpo_plan(tmp_path, {"max_completion_length": 1000}, **keys)
    assert plan.memory.peak_phase == "generation"
    limit = (plan.memory.needed - plan.memory.rollout.kv_cache // 2) / 1024**3
    cfg = grpo_config(tmp_path, {"max_completion_length": 1000}, **keys, gpu_memory_limit=f"{limit:.4f}GiB")
    with pytest.raises(ConfigError, match="gpu_memory_limit") as refused:
        refuse_what_does_not_fit(cfg)
    assert "the peak is the generation of 256 completions at once" in str(refused.value)
    assert "trl.max_completion_length" in str(refused.value)


def test_auto_micro_batch_for_grpo_holds_whole_groups(tmp_path):
    """`micro_batch_size: auto` under online RL keeps the batch a multiple of `trl.num_generations`: with one
    micro-batch per step and groups of 4, the candidates are 4, 8, ...; none fits below 4."""
    from hellbender.config import validate_config as validate_with
    from hellbender.plan.auto import choose
    from tests.test_grpo import grpo_settings

    def needed(micro_batch: int) -> float:
        return grpo_plan(tmp_path / str(micro_batch), micro_batch_size=micro_batch, gradient_accumulation_steps=1,
                         sequence_len=2048).memory.needed / 1024**3  # fmt: skip

    def auto(limit: float) -> int:
        raw = grpo_settings(tmp_path, {"reward_funcs_dir": str(tmp_path)}, micro_batch_size="auto",
                            gradient_accumulation_steps=1, sequence_len=2048, gpu_memory_limit=f"{limit:.4f}GiB")  # fmt: skip
        return validate_with(raw, choose).micro_batch_size

    assert auto((needed(4) + needed(8)) / 2) == 4
    with pytest.raises(ConfigError, match="micro_batch_size: auto.*no setting fits.*even with micro-batch 4"):
        auto(needed(4) * 0.999)
    groups_of_3 = grpo_settings(tmp_path, {"reward_funcs_dir": str(tmp_path), "num_generations": 3},
                                micro_batch_size="auto", gradient_accumulation_steps=1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"no micro-batch of 1, 2, 4, .* whole groups of `trl.num_generations: 3`"):
        validate_with(groups_of_3, choose)


def test_plan_of_a_full_dpo_run_that_does_not_fit_proposes_precomputed_reference_scores(tmp_path):
    raw = pairs_config(
        tmp_path, adapter=None, overrides_of_model_config={"hidden_size": 1024, "intermediate_size": 4096}
    )
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(raw))
    cfg = validate_config(raw)
    plan = plan_for(cfg, gpu="H100")
    budget = (plan.memory.needed - plan.memory.reference_copy // 2) / 1024**3
    result = invoke("plan", path, "--gpu-memory", f"{budget:.3f}")
    assert result.exit_code == 1, result.output
    assert "smallest change that fits: `precompute_ref_log_probs: true`" in result.output


def test_auto_micro_batch_for_kto_keeps_two_rows_for_its_kl_term(tmp_path):
    from hellbender.config import validate_config as validate_with
    from hellbender.plan.auto import choose

    kto = dict(rl="kto", datasets=[{"path": PREFERENCE_DATA, "type": "chatml.intel"}], micro_batch_size="auto")
    roomy = pairs_config(tmp_path, **kto, gpu_memory_limit="0.56GiB", sequence_len=2048)
    assert validate_with(roomy, choose).micro_batch_size == 2
    tight = pairs_config(tmp_path, **kto, gpu_memory_limit="0.53GiB", sequence_len=2048)  # only one row would fit
    with pytest.raises(ConfigError, match="micro_batch_size: auto.*no setting fits") as refused:
        validate_with(tight, choose)
    assert "rl: kto" not in str(refused.value)
