"""DPO as a user meets it, from the YAML to the model: a run prints and reports its preference accuracy, resumes
exactly in a new process, trains in two processes like in one, is scored by `hellbender evaluate`, merges and
answers with plain transformers; precomputed reference scores stay in memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.conftest import REPO
from tests.helpers import PREFERENCE_DATA, StopAt, base_config, final_weights, invoke, trainer_state
from tests.test_distributed import train_in_two_processes

STEPS, SAVE_AT, EVAL_PAIRS = 6, 3, 16


def dpo_raw(root: Path, **overrides) -> dict:
    """A short DPO LoRA run of the tiny Llama on the bundled pairs, with held-out pairs scored at the last step."""
    settings = dict(
        rl="dpo",
        datasets=[{"path": PREFERENCE_DATA, "type": "chat_template.default"}],
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        lora_target_linear=True,
        lora_dropout=0.1,  # dropout exercises the restored RNG state on resume
        micro_batch_size=8,
        max_steps=STEPS,
        save_steps=SAVE_AT,
        learning_rate=5e-3,
        val_set_size=EVAL_PAIRS,
        eval_steps=STEPS,
        eval_batch_size=EVAL_PAIRS,  # one evaluation batch: the logged means are per pair
    )
    return base_config(root, **{**settings, **overrides})


def write_yaml(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def logged(output_dir: str | Path, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in trainer_state(output_dir)["log_history"] if key in e}


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory) -> tuple[Path, dict, str]:
    """(config file, its keys, what `hellbender train` printed) of the run the tests below start from."""
    root = tmp_path_factory.mktemp("dpo")
    raw = dpo_raw(root)
    config = write_yaml(root / "config.yml", raw)
    result = invoke("train", config)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return config, raw, result.output


def test_a_run_shows_how_the_preference_is_learned(dpo_run):
    _, raw, printed = dpo_run
    lines = [line for line in printed.splitlines() if f"step 2/{STEPS}  loss " in line]
    assert lines, printed[-3000:]
    # The preference metrics come right after the loss; TRL's repeat of the token count is not shown.
    assert " loss 0.6" in lines[0] and "  rewards/accuracies " in lines[0].split("grad_norm")[0]
    assert "num_tokens" not in printed and "logits/chosen" not in printed
    assert "`gradient_checkpointing` is deprecated" not in printed  # TRL's default, set under the older name
    accuracy = logged(raw["output_dir"], "eval_rewards/accuracies")[STEPS]
    assert f"learned: preference accuracy {100 * accuracy:.0f} %" in printed
    report = (Path(raw["output_dir"]) / "report" / "report.md").read_text()
    assert "Method: DPO (preference tuning, rl_beta 0.1), LoRA" in report
    assert "- Preference accuracy (evaluation pairs): " in report and "perplexity" not in report


def test_a_stopped_run_resumes_in_a_new_process_exactly(dpo_run, tmp_path):
    _, reference, _ = dpo_run
    raw = dpo_raw(tmp_path, auto_resume_from_checkpoints=True)
    config = write_yaml(tmp_path / "config.yml", raw)
    train(validate_config(raw), callbacks=[StopAt(SAVE_AT)])  # stopped after the checkpoint ...
    assert max(logged(raw["output_dir"], "loss")) == SAVE_AT
    done = subprocess.run(  # ... and resumed in a new process
        [sys.executable, "-m", "tests.stopped_run", str(config)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = (Path(raw["output_dir"]) / "report" / "report.md").read_text()
    assert f"of training in this run, resumed at step {SAVE_AT}" in report  # not trained again from the start
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        got, expected = logged(raw["output_dir"], key), logged(reference["output_dir"], key)
        assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
        assert got == pytest.approx(expected, abs=1e-6), key
    final, expected = final_weights(raw["output_dir"]), final_weights(reference["output_dir"])
    assert final.keys() == expected.keys()
    for name in final:
        torch.testing.assert_close(final[name], expected[name], atol=1e-6, rtol=1e-6)


def test_sigterm_saves_a_checkpoint_at_the_end_of_the_step_and_the_run_resumes_to_the_same_losses(dpo_run, tmp_path):
    """A preempted DPO run (SIGTERM during step 5) saves checkpoint-5 at the end of that step, exits 143 without a
    final model, and resumed, ends where the uninterrupted run did."""
    import signal

    from transformers import TrainerCallback

    from hellbender.storage import FINAL_MANIFEST, complete_checkpoints

    class SigtermDuringStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 4:
                signal.raise_signal(signal.SIGTERM)

    _, reference, _ = dpo_run
    raw = dpo_raw(tmp_path, auto_resume_from_checkpoints=True)
    metrics = train(validate_config(raw), callbacks=[SigtermDuringStep()])
    out = Path(raw["output_dir"])
    assert metrics["exit_code"] == 128 + signal.SIGTERM
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3", "checkpoint-5"]
    assert not (out / FINAL_MANIFEST).exists()
    train(validate_config(raw))
    got, expected = logged(out, "loss"), logged(reference["output_dir"], "loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == pytest.approx(expected, abs=1e-6)


def test_two_processes_train_like_one_with_the_same_global_batch(tmp_path):
    common = dict(lora_dropout=0.0, max_steps=3, save_steps=3, val_set_size=0, eval_steps=None)
    single = validate_config(dpo_raw(tmp_path / "single", micro_batch_size=8, **common))
    train(single)
    train_in_two_processes(write_yaml(tmp_path / "ddp.yml", dpo_raw(tmp_path / "ddp", micro_batch_size=4, **common)))
    ddp_out = tmp_path / "ddp" / "out"
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        expected, got = logged(single.output_dir, key), logged(ddp_out, key)
        assert sorted(got) == [1, 2, 3]
        assert got == pytest.approx(expected, abs=1e-5), key
    a, b = final_weights(single.output_dir), final_weights(ddp_out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)
    ddp_counts = trainer_state(ddp_out)["stateful_callbacks"]["TokenCounter"]
    assert ddp_counts == trainer_state(single.output_dir)["stateful_callbacks"]["TokenCounter"]


# ------------------------------------------------------------------------------------------ evaluate


def test_evaluate_scores_the_held_out_pairs_as_training_did(dpo_run):
    config, raw, _ = dpo_run
    result = invoke("evaluate", config)
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    assert scores == json.loads((Path(raw["output_dir"]) / "eval_results.json").read_text())
    assert scores["pairs"] == scores["rows"] == EVAL_PAIRS and scores["step"] == STEPS
    assert "perplexity" not in scores and "token_accuracy" not in scores
    # The training run scored the same held-out pairs with the same final adapter at its last step.
    for ours, trl in (("loss", "eval_loss"), ("preference_accuracy", "eval_rewards/accuracies")):
        assert scores[ours] == pytest.approx(logged(raw["output_dir"], trl)[STEPS], abs=1e-6), ours
    assert scores["mean_margin"] == pytest.approx(logged(raw["output_dir"], "eval_rewards/margins")[STEPS], abs=1e-6)
    assert scores["mean_margin"] == pytest.approx(scores["chosen_reward"] - scores["rejected_reward"], abs=1e-5)
    assert scores["mean_margin"] > 0 and scores["loss"] < math.log(2)  # it learned something


def test_val_set_size_holds_out_whole_pairs(tmp_path):
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor

    def triples(rows) -> list[tuple]:
        return [(tuple(r["prompt_ids"]), tuple(r["chosen_ids"]), tuple(r["rejected_ids"])) for r in rows]

    # The bundled pairs repeat some rows (185 distinct of 300): deduplicated, no held-out pair is a training pair.
    split_cfg = validate_config(dpo_raw(tmp_path, val_set_size=0.1, dataset_exact_deduplication=True))
    whole_cfg = validate_config(dpo_raw(tmp_path, val_set_size=0))
    tokenizer, _ = load_tokenizer_and_processor(split_cfg)
    split, whole = prepare_datasets(split_cfg, tokenizer, None), prepare_datasets(whole_cfg, tokenizer, None)
    assert whole.eval is None and len(whole.train) == 300
    distinct = set(triples(whole.train))
    held_out, trained = triples(split.eval), triples(split.train)
    assert len(held_out) == math.ceil(0.1 * len(distinct)) and len(held_out) + len(trained) == len(distinct)
    # Every prepared pair lands on exactly one side, whole: a prompt never loses its chosen or rejected answer.
    assert set(held_out) | set(trained) == distinct
    assert not set(held_out) & set(trained)


# ------------------------------------------------------------------------------------------ merge, inference


def test_merge_lora_then_plain_transformers_generates(dpo_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hellbender.models.tiny import tiny_model_dir

    config, raw, _ = dpo_run
    result = invoke("merge-lora", config)
    assert result.exit_code == 0, result.output
    merged_dir = Path(raw["output_dir"]) / "merged"
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Italy?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    generated = merged.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 4 or generated[0, -1] == tokenizer.eos_token_id
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(raw["base_model"]), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, raw["output_dir"]).eval()
    with torch.no_grad():  # the merged weights compute what base + DPO adapter compute
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
        with adapted.disable_adapter():
            base_logits = adapted(ids).logits
        assert not torch.allclose(merged(ids).logits, base_logits)  # the adapter is in the merged weights

    answer = invoke("inference", config, "--prompt", "What is the capital of Italy?", "--max-new-tokens", "4")
    assert answer.exit_code == 0, answer.output
    expected = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert expected in answer.stdout


# ------------------------------------------------------------------------------------------ precomputed reference


def test_precomputed_reference_scores_train_full_weights_and_are_never_written(tmp_path):
    raw = dpo_raw(tmp_path, adapter=None, precompute_ref_log_probs=True, max_steps=2, learning_rate=1e-4)
    for key in ("lora_r", "lora_alpha", "lora_target_linear", "lora_dropout"):
        raw.pop(key)
    cfg = validate_config(raw)
    train(cfg)
    # Step 1: the policy still equals the reference whose scores were precomputed, so the loss is exactly log 2.
    assert logged(cfg.output_dir, "loss")[1] == pytest.approx(math.log(2), abs=1e-6)
    assert logged(cfg.output_dir, "rewards/margins")[2] != 0.0  # and then it trains
    assert (Path(cfg.output_dir) / "model.safetensors").is_file()
    # TRL would write its scores as a cache-*.arrow file beside the prepared pairs: no Arrow file anywhere holds them.
    from datasets import Dataset

    hf_cache = Path(os.environ["HF_DATASETS_CACHE"])
    for arrow in [*tmp_path.rglob("*.arrow"), *hf_cache.rglob("*.arrow")]:
        columns = set(Dataset.from_file(str(arrow)).column_names)
        assert not {"ref_chosen_logps", "ref_rejected_logps"} & columns, arrow
    assert not list(tmp_path.rglob("cache-*.arrow"))
    prepared = json.loads(next((tmp_path / "prepared").glob("*/hellbender_prepared.json")).read_text())
    assert prepared["key"]


@pytest.mark.parametrize(
    ("example", "described"),
    [
        ("tiny-dpo.yml", "DPO, LoRA of hellbender/tiny-llama"),
        ("qwen2.5-0.5b-dpo-lora.yml", "DPO, LoRA of Qwen/Qwen2.5-0.5B-Instruct"),
        ("llama-3.2-1b-kto-lora.yml", "KTO, LoRA of meta-llama/Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-orpo-lora.yml", "ORPO, LoRA of Qwen/Qwen2.5-0.5B-Instruct"),
        ("qwen2.5-0.5b-reward-model.yml", "reward model, LoRA of Qwen/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_the_preference_examples_validate_as_their_method(example, described):
    """Offline: validation reads neither the hub model nor the hub dataset the real-model examples name."""
    from tests.conftest import EXAMPLES

    result = invoke("validate", EXAMPLES / example)
    assert result.exit_code == 0, result.output
    assert f"({described}, 1 dataset)" in result.stdout
