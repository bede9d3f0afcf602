"""End-to-end training invariants on the built-in tiny model (CPU, fp32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.conftest import REPO
from tests.helpers import TEXT_DATA, StepSnapshot, base_config, final_weights, logged_losses


def test_loss_falls_on_a_learnable_task(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            adapter="lora",
            lora_target_linear=True,
            lora_r=16,
            max_steps=40,
            sample_packing=True,
            lora_modules_to_save=["embed_tokens", "lm_head"],
        )
    )
    metrics = train(cfg)
    losses = list(logged_losses(cfg.output_dir).values())
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.75 * first, losses
    assert metrics["trained_tokens"] > 0 and metrics["input_tokens"] > metrics["trained_tokens"]


@pytest.mark.parametrize("adapter", ["lora", None])
def test_every_trainable_parameter_changes_and_no_frozen_one(tmp_path, adapter):
    extra = {"adapter": "lora", "lora_target_linear": True, "lora_modules_to_save": ["lm_head"]} if adapter else {}
    # LoRA's B starts at zero, so A only moves from the second step on: compare after step 1 for B and the
    # rest, and rely on B having moved (a zero B gives A no gradient at step 1).
    cfg = validate_config(base_config(tmp_path, max_steps=1, learning_rate=1e-2, **extra))
    snap = StepSnapshot()
    train(cfg, callbacks=[snap.callback])
    assert snap.trainable, "nothing was trainable"
    for name, before in snap.before.items():
        changed = not torch.equal(before, snap.after[name])
        if name in snap.trainable and not (adapter and "lora_A" in name):
            assert changed, f"trainable parameter {name} did not change"
        elif name not in snap.trainable:
            assert not changed, f"frozen parameter {name} changed"
    if adapter:
        assert any("lora_B" in n for n in snap.trainable) and any("lm_head" in n for n in snap.trainable)
        assert not any("embed_tokens" in n for n in snap.trainable)


def test_lora_a_matrices_change_by_the_second_step(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, adapter="lora", lora_target_linear=True, max_steps=2, learning_rate=1e-2)
    )
    snap = StepSnapshot()
    train(cfg, callbacks=[snap.callback])
    from safetensors.torch import load_file

    saved = load_file(Path(cfg.output_dir) / "adapter_model.safetensors")
    a_names = [n for n in snap.before if "lora_A" in n]
    assert a_names
    for name in a_names:
        key = name.replace(".default", "")
        assert not torch.equal(snap.before[name].cpu(), saved[key]), f"{name} never changed"


def test_resume_in_a_new_process_reproduces_the_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    half = 4
    common = dict(
        adapter="lora",
        lora_target_linear=True,
        lora_dropout=0.1,  # dropout exercises the restored RNG state
        sample_packing=True,
        max_steps=2 * half,
        save_steps=half,
        lr_scheduler="cosine",
        warmup_steps=2,
    )
    reference = validate_config(base_config(tmp_path / "ref", **common))
    train(reference)
    expected = logged_losses(reference.output_dir)

    resumed_dir = tmp_path / "resumed"
    cfg = base_config(resumed_dir, auto_resume_from_checkpoints=True, **common)
    config_path = resumed_dir / "config.yml"
    config_path.parent.mkdir(parents=True)
    config_path.write_text(yaml.safe_dump(cfg))
    # The first process stops after the checkpoint at `half`; the second resumes to the end.
    for stop in (["--stop-at", str(half)], []):
        done = subprocess.run(
            [sys.executable, "-m", "tests.stopped_run", str(config_path), *stop],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        if stop:
            assert (Path(cfg["output_dir"]) / f"checkpoint-{half}").is_dir()
            assert max(logged_losses(cfg["output_dir"])) == half
    got = logged_losses(cfg["output_dir"])
    assert sorted(got) == sorted(expected) == list(range(1, 2 * half + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)

    state = json.loads((Path(cfg["output_dir"]) / "trainer_state.json").read_text())
    ref_state = json.loads((Path(reference.output_dir) / "trainer_state.json").read_text())
    counters = state["stateful_callbacks"]["TokenCounter"]["attributes"]
    assert counters == ref_state["stateful_callbacks"]["TokenCounter"]["attributes"]
    assert counters["trained_tokens"] > 0
    final = load_file(Path(cfg["output_dir"]) / "adapter_model.safetensors")
    ref_final = load_file(Path(reference.output_dir) / "adapter_model.safetensors")
    assert final.keys() == ref_final.keys()
    for key in final:
        torch.testing.assert_close(final[key], ref_final[key], atol=1e-6, rtol=1e-6)


def test_lora_output_loads_with_plain_transformers_and_peft(tmp_path, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = validate_config(base_config(tmp_path, adapter="lora", lora_target_linear=True, max_steps=3))
    train(cfg)
    out = Path(cfg.output_dir)
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert (out / "hellbender_config.yml").is_file()
    tokenizer = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = tokenizer("What is 2 plus 2?", return_tensors="pt")["input_ids"]
    base_logits = base(ids).logits
    model = PeftModel.from_pretrained(base, out).eval()
    tuned_logits = model(ids).logits
    assert torch.isfinite(tuned_logits).all()
    assert not torch.allclose(base_logits, tuned_logits), "the adapter changed nothing"


def test_full_finetune_output_loads_with_plain_transformers(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = validate_config(base_config(tmp_path, max_steps=3, learning_rate=1e-3))
    train(cfg)
    out = Path(cfg.output_dir)
    assert (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert AutoTokenizer.from_pretrained(out).chat_template
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert len(changed) == len(list(base.parameters()))


def test_streaming_pretraining_trains_for_max_steps(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            datasets=[],
            pretraining_dataset=[{"path": TEXT_DATA, "ds_type": "json", "text_column": "text"}],
            max_steps=8,
            sequence_len=64,
            micro_batch_size=2,
        )
    )
    assert cfg.uses_streaming
    metrics = train(cfg)
    losses = logged_losses(cfg.output_dir)
    assert sorted(losses) == list(range(1, 9))
    # Bins are filled: at most the last one of a pass is short, so nearly every position is a real token.
    assert metrics["input_tokens"] >= 0.9 * 8 * 2 * 64


def test_completion_pretraining_with_packing_and_gradient_checkpointing(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            datasets=[{"path": TEXT_DATA, "type": "completion"}],
            sample_packing=True,
            gradient_checkpointing=True,
            num_epochs=1,
            max_steps=None,
            micro_batch_size=2,
        )
    )
    metrics = train(cfg)
    # With completion every token but the first of each document is trained.
    assert metrics["trained_tokens"] == metrics["input_tokens"] - 400
    assert metrics["epoch"] == pytest.approx(1.0)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    """One step of micro-batch 4 == one step of 2 micro-batches of 2: the loss is averaged over trained
    tokens across the accumulated micro-batches, not per micro-batch."""
    common = dict(adapter="lora", lora_target_linear=True, max_steps=1, learning_rate=1e-2, sample_packing=True)
    big = validate_config(base_config(tmp_path / "big", micro_batch_size=4, gradient_accumulation_steps=1, **common))
    small = validate_config(base_config(tmp_path / "acc", micro_batch_size=2, gradient_accumulation_steps=2, **common))
    train(big)
    train(small)
    a, b = final_weights(big.output_dir), final_weights(small.output_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    assert logged_losses(big.output_dir)[1] == pytest.approx(logged_losses(small.output_dir)[1], rel=1e-5)


def test_gradients_with_and_without_activation_checkpointing_match(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from hellbender.models.activation_checkpointing import enable_activation_checkpointing

    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        model.train()
        if checkpointing:
            enable_activation_checkpointing(model)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, checkpointed = grads(False), grads(True)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)


def test_a_local_model_directory_trains_through_the_same_path(tmp_path, tiny_model_path):
    import shutil

    local = tmp_path / "my-model"
    shutil.copytree(tiny_model_path, local)
    cfg = validate_config(base_config(tmp_path, base_model=str(local), max_steps=2))
    train(cfg)
    assert sorted(logged_losses(cfg.output_dir)) == [1, 2]


def test_dora_adapter_trains_and_is_saved_as_dora(tmp_path):
    cfg = validate_config(base_config(tmp_path, adapter="lora", peft_use_dora=True, max_steps=2))
    train(cfg)
    adapter_config = json.loads((Path(cfg.output_dir) / "adapter_config.json").read_text())
    assert adapter_config["use_dora"] is True
    assert any("lora_magnitude_vector" in k for k in final_weights(cfg.output_dir))


def test_new_special_tokens_grow_the_embeddings(tmp_path):
    cfg = validate_config(
        base_config(tmp_path, special_tokens={"pad_token": "<|my_pad|>"}, max_steps=2, learning_rate=1e-3)
    )
    train(cfg)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.output_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.output_dir)
    assert tokenizer.pad_token == "<|my_pad|>"
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == 513
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_tensorboard_receives_the_training_logs(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = validate_config(base_config(tmp_path, report_to=["tensorboard"], max_steps=2))
    train(cfg)
    events = list(Path(cfg.output_dir).rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_preprocess_then_train_tokenizes_once(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import hellbender.data.prepare as prepare
    from hellbender.cli import app

    calls = []
    original = prepare.tokenize_dataset

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(prepare, "tokenize_dataset", counting)
    config = tmp_path / "config.yml"
    config.write_text(yaml.safe_dump(base_config(tmp_path, max_steps=2)))
    runner = CliRunner()
    first = runner.invoke(app, ["preprocess", str(config)])
    assert first.exit_code == 0, first.output
    assert "newly written" in first.output and "400 kept" in first.output
    second = runner.invoke(app, ["train", str(config)])
    assert second.exit_code == 0, second.output
    assert len(calls) == 1


def test_streaming_pretraining_evaluates_on_prepared_test_datasets(tmp_path):
    cfg = validate_config(
        base_config(
            tmp_path,
            datasets=[],
            pretraining_dataset=[{"path": TEXT_DATA, "ds_type": "json"}],
            test_datasets=[{"path": TEXT_DATA, "type": "completion"}],
            max_steps=4,
            eval_steps=2,
            sequence_len=64,
        )
    )
    train(cfg)
    state = json.loads((Path(cfg.output_dir) / "trainer_state.json").read_text())
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(0 < e["eval_loss"] < 10 for e in evals)
