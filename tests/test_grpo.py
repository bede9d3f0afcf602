"""GRPO (`rl: grpo`) on TRL's GRPOTrainer through hellbender: the `trl:` block's rules, reward functions read from
files next to the config and reported by name when they fail, learning a reward on a tiny task, and the reference
of a LoRA run being the base model with the adapter off."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config.loading import load_config, validate_config
from hellbender.errors import ConfigError, DataError
from tests.helpers import assert_user_error, base_config, invoke

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

# Rewards the tiny model can learn within a few steps: the share of completion tokens whose id is even (about half at
# the start), the same function failing on one row, and functions returning the wrong shape of scores.
REWARDS = """
def even_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def fails_on_seven(prompts, completions, number, **kwargs):
    for n in number:
        if n == 7:
            raise ValueError("seven is not scored")
    return [0.0 for _ in completions]


def low_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t < 256 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def too_few(prompts, completions, **kwargs):
    return [1.0]


def words(prompts, completions, **kwargs):
    return ["good" for _ in completions]


not_a_function = 3
"""


def grpo_dir(tmp_path: Path) -> Path:
    """A directory with the reward file and 32 prompt rows (`prompt`, and `number` for the reward functions)."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"question {i}", "number": i} for i in range(32)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def grpo_settings(tmp_path: Path, trl: dict | None = None, **overrides) -> dict:
    block = {"reward_funcs": ["rewards.even_share"], "num_generations": 4, "max_completion_length": 4}
    block.update(trl or {})
    settings = {
        "rl": "grpo",
        "datasets": [{"path": str(grpo_dir(tmp_path) / "prompts.jsonl")}],
        "micro_batch_size": 8,
        "trl": block,
    }
    return base_config(tmp_path, **{**settings, **overrides})


def grpo_config(tmp_path: Path, trl: dict | None = None, **overrides):
    raw = grpo_settings(tmp_path, trl, **overrides)
    raw["trl"].setdefault("reward_funcs_dir", str(tmp_path))
    return validate_config(raw)


# --- config -----------------------------------------------------------------------------------------------------


def test_a_grpo_config_reads_its_reward_functions_next_to_the_config_file(tmp_path):
    raw = grpo_settings(tmp_path)
    (tmp_path / "config.yml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "config.yml")
    assert cfg.rl == "grpo"
    assert cfg.trl.reward_funcs_dir == str(tmp_path.resolve())
    assert (cfg.trl.num_generations, cfg.trl.loss_type, cfg.trl.scale_rewards, cfg.trl.beta) == (4, "dapo", "group", 0)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"rl": None}, ["`trl:`", "`rl` is not set", "rl: grpo"]),
        ({"rl": "dpo"}, ["`trl:`", "rl: dpo"]),
        ({"trl": {"num_generations": 3}}, ["trl.num_generations: 3", "batch here is 8", "micro_batch_size: 8"]),
        ({"trl": {"reward_weights": [1.0, 2.0]}}, ["trl.reward_weights", "2 weight(s) for 1 reward function(s)"]),
        ({"trl": {"reward_funcs": ["missing.score"]}}, ["missing.score", "missing.py"]),
        ({"trl": {"reward_funcs": ["rewards.absent"]}}, ["rewards.absent", "has no `absent`"]),
        ({"trl": {"reward_funcs": ["rewards.not_a_function"]}}, ["non-callable", "not_a_function"]),
        ({"trl": {"reward_funcs": ["no_module"]}}, ["no_module", "module.function"]),
        ({"trl": {"use_liger_loss": True}}, ["trl.use_liger_loss", "not offered yet"]),
        ({"trl": {"loss_type": "luspo"}}, ["loss_type"]),
        ({"datasets": [{"path": "x.jsonl", "type": "chat_template"}]}, ["type: chat_template", "rl: grpo"]),
        ({"val_set_size": 4, "eval_batch_size": 6}, ["eval_batch_size: 6", "num_generations: 4", "multiple of 4"]),
        ({"test_datasets": [{"path": "x.jsonl", "type": "alpaca"}]}, ["test_datasets[0]", "type: alpaca"]),
        ({"curriculum_sampling": True}, ["curriculum_sampling", "rl: grpo"]),
        ({"datasets": [{"path": "x.jsonl", "field_messages": "m"}]}, ["datasets[0]", "field_messages"]),
        ({"rl_beta": 0.1}, ["rl_beta", "trl.beta"]),
        (
            {"trl": {"compile_generation": True}, "torch_compile": True},
            ["trl.compile_generation: true", "torch_compile"],
        ),
        ({"trl": {"compile_generation": True}, "adapter": "qlora"}, ["trl.compile_generation: true", "in 4 bits"]),
    ],
)
def test_grpo_config_errors_name_the_key(tmp_path, overrides, needles):
    trl = overrides.pop("trl", None)
    with pytest.raises(ConfigError) as error:
        cfg = grpo_settings(tmp_path, trl, **overrides)
        cfg["trl"].setdefault("reward_funcs_dir", str(tmp_path))
        if overrides.get("rl", "grpo") is None:
            cfg.pop("rl")
        validate_config(cfg)
    for needle in needles:
        assert needle in str(error.value), str(error.value)


def test_use_vllm_without_vllm_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr("hellbender.config.rl_checks.vllm_installed", lambda: False)
    with pytest.raises(ConfigError) as error:
        grpo_config(tmp_path, {"use_vllm": True})
    assert "pip install vllm" in str(error.value) and "remove `use_vllm`" in str(error.value)
    assert str(error.value).count("\n\n") == 0  # one paragraph


def test_compiled_generation_is_on_where_a_gpu_generates_unless_the_config_rules_it_out(tmp_path, monkeypatch, caplog):
    from hellbender.config.machine import Machine
    from hellbender.config.machine_needs import machine_problems
    from hellbender.train.methods.online import compiled_generation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compiled_generation(grpo_config(tmp_path))
    on = grpo_config(tmp_path, {"compile_generation": True})
    (problem,) = machine_problems(on, Machine(cuda=False, bf16=False, cpus=2))
    assert "`trl.compile_generation: true`" in problem and "only on a GPU" in problem and "Remove it" in problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compiled_generation(grpo_config(tmp_path))
    assert not compiled_generation(grpo_config(tmp_path, {"compile_generation": False}))
    with caplog.at_level("INFO", logger="hellbender"):
        assert not compiled_generation(grpo_config(tmp_path, torch_compile=True))
    assert "decodes eagerly" in caplog.text and "torch_compile" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="hellbender"):
        assert compiled_generation(grpo_config(tmp_path, liger_rope=True))
    assert "liger_rope" in caplog.text and "Remove `liger_rope`" in caplog.text


def test_compiled_generation_gives_trl_a_static_cache_and_compilation(tmp_path, monkeypatch):
    """What `trl.compile_generation` hands TRL (whose own generation config has compilation off): a static key-value
    cache, which transformers' compiled decoding step needs, compilation on, and the prompts read into the cache 64
    positions at a time; off, TRL's eager defaults."""
    monkeypatch.setattr("hellbender.train.methods.online.compiled_generation", lambda cfg: True)
    for name in ("on", "off"):
        (tmp_path / name).mkdir()
    trainer, _ = recording_trainer(grpo_config(tmp_path / "on"))
    config = trainer.generation_config
    assert (config.cache_implementation, config.disable_compile, config.prefill_chunk_size) == ("static", False, 64)
    monkeypatch.undo()
    trainer, _ = recording_trainer(grpo_config(tmp_path / "off"))
    config = trainer.generation_config
    assert (config.cache_implementation, config.disable_compile, config.prefill_chunk_size) == (None, True, None)


def test_ebft_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match="rl: ebft"):
        validate_config(base_config(tmp_path, rl="ebft"))


def test_gdpo_is_grpo_normalising_each_reward_before_the_sum(tmp_path):
    cfg = grpo_config(tmp_path, rl="gdpo")
    assert (cfg.rl, cfg.trl.multi_objective_aggregation, cfg.trl.loss_type) == ("gdpo", "normalize_then_sum", "dapo")
    assert grpo_config(tmp_path).trl.multi_objective_aggregation == "sum_then_normalize"
    from hellbender.train.methods import preference_method

    config_class, fields = preference_method(cfg).arguments(cfg)
    assert set(fields) <= {f.name for f in dataclasses.fields(config_class)}  # TRL's own field names
    assert (fields["multi_objective_aggregation"], fields["importance_sampling_level"]) == (
        "normalize_then_sum",
        "token",
    )
    sequence = grpo_config(tmp_path, {"importance_sampling_level": "sequence"})
    assert preference_method(sequence).arguments(sequence)[1]["importance_sampling_level"] == "sequence"
    with pytest.raises(ConfigError) as error:
        grpo_config(tmp_path, {"multi_objective_aggregation": "sum_then_normalize"}, rl="gdpo")
    assert "rl: gdpo" in str(error.value) and "Set `rl: grpo`" in str(error.value)


@pytest.mark.parametrize(
    ("trl", "needles"),
    [
        ({"multi_objective_aggregation": "normalize_then_sum"}, ["trl.multi_objective_aggregation", "rl: rloo"]),
        ({"importance_sampling_level": "sequence"}, ["trl.importance_sampling_level", "rl: rloo"]),
        ({"num_completions_to_print": 2}, ["num_completions_to_print", "log_completions` is off"]),
    ],
)
def test_grpo_only_and_logging_keys_are_refused_where_they_change_nothing(tmp_path, trl, needles):
    method = "rloo" if "rl: rloo" in needles else "grpo"
    with pytest.raises(ConfigError) as error:
        grpo_config(tmp_path, trl, rl=method)
    for needle in needles:
        assert needle in str(error.value), str(error.value)


def test_the_loss_types_offered_are_trls():
    from typing import get_args

    from trl import GRPOConfig

    from hellbender.config.rl import GrpoLossType

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert set(get_args(GrpoLossType)) <= set(__import__("re").findall(r"'([a-z_]+)'", help_text))


# --- reward functions ------------------------------------------------------------------------------------------


def test_reward_function_returns_of_the_wrong_shape_are_named(tmp_path):
    from hellbender.config.reward_functions import load_reward_function
    from hellbender.data.grpo_rows import ROW_COLUMN
    from hellbender.train.methods.online import RewardFunction

    grpo_dir(tmp_path)
    call = {"prompts": ["a", "b"], "completions": ["x", "y"], "number": [3, 7], ROW_COLUMN: [13, 17]}
    short = RewardFunction("rewards.too_few", load_reward_function("rewards.too_few", tmp_path))
    with pytest.raises(
        DataError, match=r"`rewards.too_few` returned 1 score\(s\) for 2 completions \(training rows 13, 17"
    ):
        short(**call)
    text = RewardFunction("rewards.words", load_reward_function("rewards.words", tmp_path))
    with pytest.raises(
        DataError, match=r"`rewards.words` returned 'good' \(str\) for completion 0 \(training row 13\)"
    ):
        text(**call)
    failing = RewardFunction("rewards.fails_on_seven", load_reward_function("rewards.fails_on_seven", tmp_path))
    with pytest.raises(DataError, match=r"`rewards.fails_on_seven` failed on training row 17 .*seven is not scored"):
        failing(**call)
    scored = RewardFunction("rewards.even_share", load_reward_function("rewards.even_share", tmp_path))
    assert scored(**call, completion_ids=[[2, 4], [1, 2]]) == [1.0, 0.5]  # the row column is not passed on


def test_a_reward_function_that_raises_stops_training_with_one_paragraph(tmp_path):
    raw = grpo_settings(tmp_path, {"reward_funcs": ["rewards.fails_on_seven"]})
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(raw))
    result = invoke("train", config)
    assert_user_error(result, "rewards.fails_on_seven", "training row 7", "seven is not scored")


# --- training --------------------------------------------------------------------------------------------------


def logged_rewards(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["reward"] for entry in history if "reward" in entry]


def test_grpo_learns_the_reward_of_a_tiny_task(tmp_path):
    """Full fine-tuning, 20 steps of 2 prompts x 4 completions of 4 tokens: the mean reward of the first 5 steps is
    0.53 (about half the tokens are even at the start), of the last 5 steps 0.98 (measured on CPU, seed 42)."""
    from hellbender.train.run import train

    cfg = grpo_config(tmp_path, max_steps=20, learning_rate=2e-2)
    train(cfg)
    rewards = logged_rewards(Path(cfg.output_dir))
    assert len(rewards) == 20
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.65 and last > 0.85, rewards
    report = (Path(cfg.output_dir) / "report" / "report.md").read_text()
    assert "Method: GRPO (online reinforcement learning, 4 completions per prompt" in report
    assert f"Mean reward (generated completions, per logged step): {rewards[0]:.4g} at step 1" in report
    assert "`even_share`" in report
    assert "- Batch: 8 completions x 1 accumulation steps (4 per prompt); completions up to 4 tokens" in report
    resolved = load_config(Path(cfg.output_dir) / "hellbender_config.yml")  # as a resumed run reads it
    assert resolved.trl == cfg.trl and resolved.datasets[0].type == "pretokenized"


def head_aligned_task(tmp_path: Path, tiny_model_path: Path) -> Path:
    """The tiny model with its output head scaled by 10, saved under `tmp_path/model`, and the reward `aligned.share`
    in `tmp_path/aligned.py`: the share of completion tokens on one side of the head's main direction."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "model")
    head = model.lm_head.weight.detach()
    direction = torch.linalg.svd(head - head.mean(0), full_matrices=False).Vh[0]
    aligned = sorted(torch.nonzero(head @ direction > 0).flatten().tolist())
    (tmp_path / "aligned.py").write_text(
        f"ALIGNED = set({aligned})\n\n\ndef share(prompts, completions, completion_ids, **kwargs):\n"
        "    return [sum(t in ALIGNED for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
    )
    return tmp_path / "model"


def test_grpo_with_lora_learns_a_reward_the_output_head_can_express(tmp_path, tiny_model_path):
    """LoRA (all linear layers, not the output head) learns within 20 steps: the mean reward of the first 5 steps
    is 0.54, of the last 5 steps 1.0 (measured on CPU, seed 42).

    LoRA moves only the last hidden state, whose length the final RMS norm fixes (8 in the tiny model), so it can
    shift a token's logit by at most 8 x the length of that token's output-head row. The built-in tiny model's head
    is random and small (rows of length 0.16): even and odd token ids differ by at most 0.12 in logit, so the
    even-token reward above cannot be learned with LoRA there (0.50 -> 0.56 at learning rates up to 0.2). Here the
    head is scaled by 10 and the rewarded tokens are those on one side of the head's main direction, which the
    hidden state can point along."""
    from safetensors.torch import load_file

    from hellbender.train.run import train

    model_dir = head_aligned_task(tmp_path, tiny_model_path)
    cfg = grpo_config(
        tmp_path,
        {"reward_funcs": ["aligned.share"]},
        base_model=str(model_dir),
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        lora_target_linear=True,
        max_steps=20,
        learning_rate=2e-2,
    )
    train(cfg)
    rewards = logged_rewards(Path(cfg.output_dir))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.65 and last > 0.9, rewards
    saved = load_file(Path(cfg.output_dir) / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # the adapter learned it; the head was not trained


def recording_trainer(cfg) -> tuple[object, list[dict]]:
    """The trainer `hellbender train` builds for `cfg` on its prompt rows, and the list each generated and scored
    batch is appended to (before TRL shuffles and splits it)."""
    from hellbender.data.grpo_rows import grpo_rows
    from hellbender.models.loading import load_tokenizer_and_processor
    from hellbender.models.stack import build_trainable_model
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.schedule import plan_schedule
    from hellbender.train.tokens import TokenCounter

    method = preference_method(cfg)
    tokenizer, processor = load_tokenizer_and_processor(cfg)
    model = build_trainable_model(cfg, tokenizer)
    rows = grpo_rows(cfg)
    schedule = plan_schedule(cfg, len(rows) * cfg.trl.num_generations, 1)
    args = training_arguments(cfg, schedule, False, False, *method.arguments(cfg))
    trainer = method.build_trainer(cfg, model, args, rows, None, processor or tokenizer, callbacks=[TokenCounter()])
    batches: list[dict] = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        batches.append(generate(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = recorded
    return trainer, batches


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_advantages_follow_the_group_relative_formula(tmp_path, scale_rewards):
    """The advantages TRL trains with, from the weighted sum of two reward functions: the reward minus its group's
    mean, divided by the unbiased standard deviation of the group (`group`, `true`), of the whole batch (`batch`), or
    not at all (`none`, `false`), with TRL's 1e-4 beside it."""
    from hellbender.config.reward_functions import load_reward_function

    trl = {"reward_funcs": ["rewards.even_share", "rewards.low_share"], "reward_weights": [1.0, 0.5]}
    cfg = grpo_config(tmp_path, {**trl, "scale_rewards": scale_rewards}, max_steps=1, micro_batch_size=16)
    trainer, batches = recording_trainer(cfg)
    trainer.train()
    batch = batches[0]
    ids = [
        row[mask.bool()].tolist() for row, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    scores = [
        load_reward_function(name, tmp_path)(prompts=[], completions=[], completion_ids=ids)
        for name in trl["reward_funcs"]
    ]
    rewards = torch.tensor(scores[0]) + 0.5 * torch.tensor(scores[1])
    groups = rewards.view(-1, 4)
    centred = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    spread = {
        "group": groups.std(dim=1).repeat_interleave(4),
        "batch": rewards.std().expand(16),
        "none": None,
    }[cfg.trl.scale_rewards]
    expected = centred if spread is None else centred / (spread + 1e-4)
    assert cfg.trl.scale_rewards == {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    assert rewards.std() > 0  # the rewards differ, so the three scalings differ
    torch.testing.assert_close(batch["advantages"].cpu(), expected, atol=1e-5, rtol=1e-5)


def test_gdpo_advantages_normalise_each_reward_in_its_group_then_the_weighted_sum(tmp_path):
    """`rl: gdpo`: each reward function's scores minus its group's mean, divided by the group's unbiased standard
    deviation (+1e-4), summed with the weights; then that sum standardised over the whole batch (TRL's GDPO)."""
    from hellbender.config.reward_functions import load_reward_function

    trl = {"reward_funcs": ["rewards.even_share", "rewards.low_share"], "reward_weights": [1.0, 0.5]}
    cfg = grpo_config(tmp_path, trl, rl="gdpo", max_steps=1, micro_batch_size=16)
    trainer, batches = recording_trainer(cfg)
    trainer.train()
    batch = batches[0]
    ids = [
        row[mask.bool()].tolist() for row, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    normalised = []
    for name in trl["reward_funcs"]:
        groups = torch.tensor(load_reward_function(name, tmp_path)(prompts=[], completions=[], completion_ids=ids))
        groups = groups.view(-1, 4)
        normalised.append((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4))
    summed = (normalised[0] + 0.5 * normalised[1]).flatten()
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert summed.std() > 0
    torch.testing.assert_close(batch["advantages"].cpu(), expected, atol=1e-5, rtol=1e-5)


def test_log_completions_writes_every_completion_and_prints_the_asked_number(tmp_path, capsys):
    import pandas as pd

    cfg = grpo_config(tmp_path, {"log_completions": True, "num_completions_to_print": 2}, max_steps=2)
    trainer, _ = recording_trainer(cfg)
    trainer.train()
    written = sorted((Path(cfg.output_dir) / "completions").glob("completions_*.parquet"))
    assert [p.name for p in written] == ["completions_00001.parquet", "completions_00002.parquet"]
    table = pd.read_parquet(written[-1])
    assert len(table) == 8 and {"prompt", "completion", "even_share", "advantage"} <= set(table.columns)
    assert set(table["step"]) == {2}
    printed = capsys.readouterr().out
    tables = printed.count(" Step ")
    assert tables >= 2 and printed.count("│ question") == 2 * tables  # two completions printed per table


def test_the_lora_reference_is_the_base_model_with_the_adapter_off(tmp_path, tiny_model_path):
    """With `trl.beta > 0` and LoRA, the reference log-probabilities TRL uses for the KL term equal those of the
    base model loaded on its own, while the trained adapter's differ from them."""
    from transformers import AutoModelForCausalLM

    cfg = grpo_config(tmp_path, {"beta": 0.1}, adapter="lora", lora_r=8, lora_alpha=16, max_steps=3, learning_rate=5e-2)
    trainer, batches = recording_trainer(cfg)
    assert "ref" not in trainer.model.peft_config  # no second adapter: the base is the reference
    trainer.train()
    batch = batches[-1]  # generated after two optimizer steps: the adapter is no longer zero
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]

    def completion_log_probs(scorer) -> torch.Tensor:
        with torch.no_grad():
            logits = scorer(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    scored = batch["completion_mask"].bool()
    expected = completion_log_probs(base)[scored]
    torch.testing.assert_close(batch["ref_per_token_logps"][scored], expected, atol=1e-5, rtol=1e-5)
    trainer.model.eval()
    policy = completion_log_probs(trainer.model)[scored]
    assert (policy - expected).abs().max() > 1e-3  # the adapter has moved: the check above could fail
    assert math.isfinite(float(policy.sum()))


@pytest.mark.parametrize("adapter", ["lora", None])
def test_generation_runs_without_checkpointing_and_training_keeps_hellbenders_own(tmp_path, adapter):
    """TRL generates with the policy in training mode. transformers (up to at least 5.17) then routes every decoder
    layer whose checkpointing flag is set through the checkpoint function and drops its KV cache: each token is
    generated without the earlier ones, slower and wrong. So no layer checkpoints inside `generate`; around it the
    layers checkpoint exactly as hellbender set them up (its function, only the first `gradient_checkpointing_layers`
    layers), and the checkpoint function runs in training."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    cfg = grpo_config(
        tmp_path,
        adapter=adapter,
        lora_r=8,
        lora_alpha=16,
        gradient_checkpointing=True,
        gradient_checkpointing_layers=1,
        max_steps=2,
    )
    trainer, _ = recording_trainer(cfg)
    model = trainer.model
    base = model.get_base_model() if adapter else model
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    set_up = [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers]
    assert [flag for flag, _ in set_up] == [True] + [False] * (len(layers) - 1)
    own_function = set_up[0][1]
    checkpointed: list[bool] = []  # per call of hellbender's checkpoint function: inside `generate`?
    inside_generate = [False]

    def counted(*args, **kwargs):
        checkpointed.append(inside_generate[0])
        return own_function(*args, **kwargs)

    for layer in layers:
        layer._gradient_checkpointing_func = counted
    generate = model.generate
    flags_while_generating: list[list[bool]] = []

    def watched(*args, **kwargs):
        flags_while_generating.append(
            [m.gradient_checkpointing for m in base.modules() if hasattr(m, "gradient_checkpointing")]
        )
        inside_generate[0] = True
        try:
            return generate(*args, **kwargs)
        finally:
            inside_generate[0] = False

    model.generate = watched
    trainer.train()
    assert len(flags_while_generating) == 2  # one generation per optimizer step
    assert not any(any(flags) for flags in flags_while_generating)
    assert checkpointed and not any(checkpointed)  # training checkpointed; generation never did
    assert [(layer.gradient_checkpointing, layer._gradient_checkpointing_func) for layer in layers] == [
        (flag, counted) for flag, _ in set_up
    ]


def test_a_resumed_grpo_run_repeats_the_uninterrupted_one(tmp_path):
    """Resumed from checkpoint-3 (in this process), steps 4 to 6 generate and score the same completions and take the
    same gradients as the uninterrupted run: the sampling's random state and the prompt order come back."""
    from hellbender.train.run import train

    def steps(history: list[dict]) -> list[tuple[int, float, float]]:
        return [(e["step"], e["reward"], round(e["grad_norm"], 5)) for e in history if "reward" in e]

    cfg = grpo_config(tmp_path, max_steps=6, save_steps=3, learning_rate=2e-2)
    train(cfg)
    state = Path(cfg.output_dir) / "trainer_state.json"
    uninterrupted = steps(json.loads(state.read_text())["log_history"])
    assert len({reward for _, reward, _ in uninterrupted}) > 1  # the rewards vary: equal ones would prove nothing
    state.unlink()
    resumed_cfg = grpo_config(
        tmp_path, max_steps=6, save_steps=3, learning_rate=2e-2, resume_from_checkpoint=f"{cfg.output_dir}/checkpoint-3"
    )
    train(resumed_cfg)
    resumed = steps(json.loads(state.read_text())["log_history"])
    assert resumed[3:] == uninterrupted[3:]


def test_the_tiny_grpo_example_is_copied_with_its_reward_file_and_validates(tmp_path):
    """`hellbender examples tiny-grpo` copies the config, its prompts and the reward file it names; the copy
    validates where it lands (the reward file is found next to it). Trained, it goes from a mean reward of 0.51 at
    step 1 to 1.0 at step 40 in about 45 s on 2 CPU cores (not run here)."""
    result = invoke("examples", "tiny-grpo", "--dest", tmp_path / "copy")
    assert result.exit_code == 0, result.output
    copied = tmp_path / "copy"
    assert (copied / "tiny_grpo_rewards.py").is_file() and (copied / "data" / "grpo_prompts.jsonl").is_file()
    cfg = load_config(copied / "tiny-grpo.yml")
    assert cfg.trl.reward_funcs == ["tiny_grpo_rewards.even_tokens"]
    assert cfg.trl.reward_funcs_dir == str(copied.resolve())


def test_the_gsm8k_example_copies_its_code_validates_and_scores_completions(tmp_path):
    """The real-model GRPO example: copied with the file its transform and reward functions live in, it validates
    offline; the transform makes prompt rows of a GSM8K row, and the rewards score a right, a wrong and an unformatted
    answer as documented."""
    import importlib.util

    result = invoke("examples", "llama-3.2-1b-grpo-gsm8k", "--dest", tmp_path / "copy")
    assert result.exit_code == 0, result.output
    copied = tmp_path / "copy"
    cfg = load_config(copied / "llama-3.2-1b-grpo-gsm8k.yml")
    assert cfg.datasets[0].type == "gsm8k_grpo.gsm8k" and len(cfg.trl.reward_funcs) == 2

    spec = importlib.util.spec_from_file_location("gsm8k_grpo_copy", copied / "gsm8k_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    transform, options = module.gsm8k(cfg, dataset_idx=0)
    row = transform(
        {"question": "Ann has 3 apples and buys 1,204 more. How many?", "answer": "3+1204=1207\n#### 1,207"}
    )
    assert row["answer"] == "1207" and row["prompt"][-1] == {"role": "user", "content": row["prompt"][-1]["content"]}
    assert options == {"remove_columns": ["question"]}
    completions = [
        [{"role": "assistant", "content": "3 + 1204 = 1207\n#### 1,207"}],
        [{"role": "assistant", "content": "3 + 1204 = 1208\n#### 1208"}],
        [{"role": "assistant", "content": "The answer is 1207."}],
    ]
    answers = ["1207"] * 3
    assert module.correct_answer(None, completions, answer=answers) == [1.0, 0.0, 0.0]
    assert module.answer_format(None, completions) == [0.2, 0.2, 0.0]
