"""`hellbender merge-lora`: the merged model computes what base + adapter compute, and it is a plain transformers
model directory (base parameter names, safetensors, config, generation config, tokenizer / processor)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets  # noqa: F401 - imported before any CliRunner call (see tests/test_cli_errors.py)
import pytest
import torch
import yaml
from safetensors import safe_open

from hellbender.storage import FINAL_MANIFEST, incompleteness
from hellbender.use.merge import MERGE_INFO
from tests.helpers import assert_user_error, invoke
from tests.test_multimodal_training import square
from tests.trained_runs import base_model_dir, load_base, load_with_peft, model_class

PROMPT = [{"role": "user", "content": "What is 5 plus 9?"}]


def saved_parameter_names(directory: Path) -> dict[str, str]:
    """name -> dtype of every tensor in the directory's safetensors files."""
    names = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names.update({k: str(f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    return names


def merge(run, *args) -> Path:
    result = invoke("merge-lora", run.config, *args)
    assert result.exit_code == 0, result.output
    return Path(result.output.strip().splitlines()[-1].split("merged: ", 1)[1])


def assert_standalone_model_dir(merged: Path, run) -> None:
    """What a serving engine reads: the base model's parameter names (nothing of PEFT), complete files."""
    assert incompleteness(merged, FINAL_MANIFEST) is None
    names = saved_parameter_names(merged)
    assert set(names) == set(saved_parameter_names(base_model_dir(run)))
    assert not any("lora" in n or n.startswith("base_model.") for n in names)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (merged / name).is_file(), name
    assert json.loads((merged / MERGE_INFO).read_text())["base_model"] == run.raw["base_model"]


def test_merged_text_model_computes_what_base_plus_adapter_computes(trained_text_lora, tmp_path):
    from transformers import AutoTokenizer

    run = trained_text_lora
    merged_dir = merge(run)
    assert merged_dir == run.output_dir / "merged"
    assert_standalone_model_dir(merged_dir, run)

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)  # plain transformers, from the merged directory
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    merged = model_class(run).from_pretrained(merged_dir).eval()
    assert next(merged.parameters()).dtype == torch.float32
    with torch.no_grad():
        merged_logits = merged(**ids).logits
        adapted_logits = load_with_peft(run)(**ids).logits
        base_logits = load_base(run)(**ids).logits
    # The adapter (and the trained lm_head) changed the outputs, so equality below means something.
    assert (adapted_logits - base_logits).abs().max() > 1e-2
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-5, rtol=0)

    # Generation stops at the chat template's end-of-turn token as well as at EOS.
    eos = json.loads((merged_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set(eos) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_merged_vlm_computes_what_base_plus_adapter_computes(trained_vlm_lora):
    from transformers import AutoImageProcessor, AutoTokenizer

    from hellbender.config import validate_config
    from hellbender.models.loading import load_tokenizer_and_processor

    run = trained_vlm_lora
    merged_dir = merge(run)
    assert_standalone_model_dir(merged_dir, run)
    assert (merged_dir / "processor_config.json").is_file()
    AutoTokenizer.from_pretrained(merged_dir)
    AutoImageProcessor.from_pretrained(merged_dir)  # the full processor needs torchvision for its video part

    _, processor = load_tokenizer_and_processor(validate_config(dict(run.raw)))
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}
    prompt = processor.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[[square("blue", 8, 8)]], add_special_tokens=False, return_tensors="pt")
    merged = model_class(run).from_pretrained(merged_dir).eval()
    with torch.no_grad():
        merged_logits = merged(**batch).logits
        adapted_logits = load_with_peft(run)(**batch).logits
        base_logits = load_base(run)(**batch).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-5, rtol=0)


def test_merge_a_checkpoint_into_a_chosen_directory_and_merge_again(trained_text_lora, tmp_path):
    run = trained_text_lora
    checkpoint = run.output_dir / "checkpoint-10"
    target = tmp_path / "merged-10"
    assert merge(run, "--adapter", checkpoint, "--output", target, "--max-shard-size", "200KB") == target
    assert len(list(target.glob("*.safetensors"))) > 1  # sharded
    assert (target / "model.safetensors.index.json").is_file()
    info = json.loads((target / MERGE_INFO).read_text())
    assert info["adapter_step"] == 10 and info["dtype"] == "float32" and not info["dequantized_from_4bit"]
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        merged_logits = model_class(run).from_pretrained(target).eval()(ids).logits
        torch.testing.assert_close(merged_logits, load_with_peft(run, checkpoint)(ids).logits, atol=1e-5, rtol=0)
    # A second merge into the same place replaces the first one whole.
    merge(run, "--adapter", checkpoint, "--output", target)
    assert incompleteness(target, FINAL_MANIFEST) is None
    assert not list(target.parent.glob(".merged-10*"))  # no staging or replaced copy left behind


@pytest.mark.parametrize(
    ("override", "said", "bits"),
    [("adapter=qlora", "trained in 4-bit (QLoRA)", 4), ("load_in_8bit=true", "trained in 8-bit", 8)],
)
def test_a_quantized_base_is_merged_unquantized_in_bfloat16_and_says_so(
    trained_text_lora, tmp_path, caplog, override, said, bits
):
    run = trained_text_lora
    target = tmp_path / f"merged-{bits}bit"
    assert merge(run, "--set", override, "--output", target) == target  # on CPU too: nothing is quantized
    assert said in caplog.text and "loaded unquantized in bfloat16" in caplog.text
    assert set(saved_parameter_names(target).values()) == {"BF16"}
    info = json.loads((target / MERGE_INFO).read_text())
    assert (info["dequantized_from_4bit"], info["dequantized_from_8bit"]) == (bits == 4, bits == 8)


# ------------------------------------------------------------------------------------------------ errors


def test_merge_without_an_adapter_is_refused(trained_text_lora, tmp_path):
    full = {k: v for k, v in trained_text_lora.raw.items() if k != "adapter" and not k.startswith("lora_")}
    config = tmp_path / "full.yml"
    config.write_text(yaml.safe_dump(full))
    assert_user_error(invoke("merge-lora", config), "no `adapter`", "whole model")


@pytest.mark.parametrize(
    "where, needles",
    [
        ("missing", ["does not exist"]),
        ("run_dir", ["hellbender_checkpoint.json", "checkpoint-10, checkpoint-20", "point at one of those"]),
        ("truncated", ["adapter_model.safetensors has", "where the manifest says"]),
    ],
)
def test_merge_from_a_directory_that_is_not_a_checkpoint_is_refused(trained_text_lora, tmp_path, where, needles):
    import shutil

    run = trained_text_lora
    if where == "missing":
        adapter = tmp_path / "nowhere"
    elif where == "run_dir":
        adapter = tmp_path / "run"
        (adapter / "checkpoint-10").mkdir(parents=True)
        (adapter / "checkpoint-20").mkdir()
    else:
        adapter = tmp_path / "checkpoint-10"
        shutil.copytree(run.output_dir / "checkpoint-10", adapter)
        weights = adapter / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    result = invoke("merge-lora", run.config, "--adapter", adapter, "--output", tmp_path / "merged")
    assert_user_error(result, "--adapter", *needles)
    assert not (tmp_path / "merged").exists()


def test_merge_leaves_an_existing_directory_alone(trained_text_lora, tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    result = invoke("merge-lora", trained_text_lora.config, "--output", target)
    assert_user_error(result, "--output", "left alone")
    assert (target / "notes.txt").read_text() == "keep me"


def test_merge_of_a_full_fine_tune_checkpoint_is_refused(trained_text_lora, tmp_path):
    # A whole-model directory with a complete manifest, as full fine-tuning saves it.
    from hellbender.storage import write_manifest

    whole = tmp_path / "checkpoint-3"
    load_base(trained_text_lora).save_pretrained(whole)
    write_manifest(whole)
    result = invoke("merge-lora", trained_text_lora.config, "--adapter", whole, "--output", tmp_path / "m")
    assert_user_error(result, "holds a whole model", "not a LoRA adapter")
