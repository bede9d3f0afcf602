"""The CLI on bad input: exit code 2, one message naming the key / file / row, and no traceback.

Commands run in-process through `typer.testing.CliRunner`; one test runs a real process to check its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hellbender.config import load_config
from hellbender.errors import ConfigError
from tests.conftest import EXAMPLES, write_config, write_jsonl
from tests.helpers import assert_user_error, invoke

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus 1?"}, {"role": "assistant", "content": f"{i + 1}."}]}
    for i in range(8)
]
TEXT_ROWS = [{"text": f"Document number {i} is about the sea."} for i in range(8)]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("HELLBENDER_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def make_config(tmp_path: Path, body: str, name: str = "config.yml") -> Path:
    head = (
        "base_model: hellbender/tiny-llama\n"
        f"output_dir: {tmp_path / 'out'}\n"
        f"dataset_prepared_path: {tmp_path / 'prepared'}\n"
        "sequence_len: 64\n"
    )
    return write_config(tmp_path / name, head + body)


def dataset_entry(path: Path, type_: str) -> str:
    return f"datasets:\n  - path: {path}\n    type: {type_}\n"


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("command", ["validate", "preprocess", "train", "plan"])
def test_unknown_key(tmp_path, command):
    data = write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)
    config = make_config(tmp_path, dataset_entry(data, "completion") + "learning_rat: 0.001\n")
    assert_user_error(invoke(command, config), "`learning_rat`", "Did you mean `learning_rate`")


def test_unknown_key_in_dataset_entry(tmp_path):
    config = make_config(tmp_path, f"datasets:\n  - path: {tmp_path / 'x.jsonl'}\n    typ: completion\n")
    assert_user_error(invoke("validate", config), "`datasets[0]`", "`typ`", "Did you mean `type`")


def test_unsupported_axolotl_key(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion") + "neftune_noise_alpha: 5\n")
    assert_user_error(invoke("train", config), "`neftune_noise_alpha` is not supported yet")


def test_wrong_type(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion") + "micro_batch_size: abc\n")
    assert_user_error(invoke("train", config), "`micro_batch_size`", "abc")


def test_missing_config_file(tmp_path):
    missing = tmp_path / "no_such_config.yml"
    assert_user_error(invoke("train", missing), "no_such_config.yml", "does not exist")


def test_yaml_syntax_error(tmp_path):
    config = write_config(tmp_path / "broken.yml", "base_model: x\nlearning_rate: 1\n  micro_batch_size: 2\n")
    assert_user_error(invoke("validate", config), "broken.yml", "line 3")


def test_max_steps_missing_with_streaming_pretraining_dataset(tmp_path):
    data = write_jsonl(tmp_path / "corpus.jsonl", TEXT_ROWS)
    config = make_config(tmp_path, f"pretraining_dataset:\n  - path: {data}\n")
    assert_user_error(invoke("train", config), "`max_steps` is missing", "max_steps: 1000")


def test_bad_override_form(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion"))
    assert_user_error(invoke("validate", config, "--set", "learning_rate"), "`learning_rate`", "KEY=VALUE")


def test_override_value_that_is_not_valid_yaml(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion"))
    assert_user_error(invoke("validate", config, "--set", "micro_batch_size=[1,"), "micro_batch_size")


def test_override_unknown_key(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion"))
    assert_user_error(invoke("validate", config, "--set", "learning_rat=0.1"), "Did you mean `learning_rate`")


# ---------------------------------------------------------------- data errors


def test_missing_dataset_file(tmp_path):
    missing = tmp_path / "nothere.jsonl"
    config = make_config(tmp_path, dataset_entry(missing, "completion"))
    assert_user_error(invoke("preprocess", config), str(missing), "no such file")


def test_malformed_jsonl_names_the_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n{"text": "d"}\n')
    config = make_config(tmp_path, dataset_entry(data, "completion"))
    assert_user_error(invoke("preprocess", config), "bad.jsonl", "line 3", "not valid JSON")


def test_empty_dataset_file(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    config = make_config(tmp_path, dataset_entry(data, "completion"))
    assert_user_error(invoke("preprocess", config), "empty.jsonl")


def test_unknown_chat_role_names_the_row_and_role(tmp_path):
    rows = [CHAT_ROWS[0], {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = make_config(tmp_path, dataset_entry(data, "chat_template"))
    assert_user_error(invoke("preprocess", config), "chat.jsonl", "row 1", "unknown role `robot`")


def test_error_message_is_printed_verbatim(tmp_path):
    # The hint of the unknown-role error contains `[robot]`; printed as Rich markup, the brackets vanish.
    rows = [{"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = make_config(tmp_path, dataset_entry(data, "chat_template"))
    assert_user_error(invoke("preprocess", config), "`roles: {assistant: [robot]}`")


def test_pretraining_dataset_without_streaming_fails_cleanly_or_prepares_it(tmp_path):
    # `streaming: false` is accepted for `pretraining_dataset`; preprocess must then prepare it or say why not.
    data = write_jsonl(tmp_path / "corpus.jsonl", TEXT_ROWS)
    config = make_config(tmp_path, f"pretraining_dataset:\n  - path: {data}\nstreaming: false\n")
    result = invoke("preprocess", config)
    if result.exit_code == 2:
        assert_user_error(result, "streaming")
    else:
        assert result.exit_code == 0, f"{result.exception!r}\n{result.output}"
        assert f"{len(TEXT_ROWS)} rows read" in result.output


# ---------------------------------------------------------------- environment errors


def test_qlora_on_cpu_machine(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, so qlora can load")
    data = write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)
    config = make_config(tmp_path, dataset_entry(data, "completion") + "adapter: qlora\nmax_steps: 1\n")
    result = invoke("train", config)
    assert_user_error(result, "`adapter: qlora`", "CUDA", "GPU")
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ---------------------------------------------------------------- good configs, --debug, examples


def good_config(tmp_path: Path) -> Path:
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    return make_config(tmp_path, dataset_entry(data, "chat_template") + "adapter: lora\n")


def test_validate_ends_with_one_verdict_line(tmp_path):
    config = good_config(tmp_path)
    result = invoke("validate", config)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"# valid: {config} (LoRA of hellbender/tiny-llama, 1 dataset); `--print` shows every key as it will run"
    ]


def test_validate_writes_the_resolved_config_to_a_file(tmp_path):
    config = good_config(tmp_path)
    result = invoke("validate", config, "--output", tmp_path / "resolved.yml")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "resolved.yml").read_text()) == load_config(config).model_dump(mode="json")


def test_validate_prints_the_resolved_config(tmp_path):
    result = invoke("validate", good_config(tmp_path), "--print")
    assert result.exit_code == 0, result.output
    assert "learning_rate: 0.0002" in result.stdout
    assert "attn_implementation: sdpa" in result.stdout
    assert "error" not in result.output


def test_validate_output_is_the_resolved_config_as_yaml(tmp_path):
    # The printed config is meant to be read (and saved) as YAML; long values must not be wrapped.
    data = write_jsonl(tmp_path / ("a_rather_long_directory_name_for_the_data" * 2) / "chat.jsonl", CHAT_ROWS)
    config = make_config(tmp_path, dataset_entry(data, "chat_template") + "adapter: lora\n")
    result = invoke("validate", config, "--print")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == load_config(config).model_dump(mode="json")


def test_validate_does_not_load_the_model_or_data(tmp_path, monkeypatch):
    import hellbender.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("validate must not load the model or tokenizer")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(loading, "load_tokenizer", refuse)
    config = make_config(tmp_path, dataset_entry(tmp_path / "not_written_yet.jsonl", "completion"))
    result = invoke("validate", config, "--print")
    assert result.exit_code == 0, f"{result.exception!r}\n{result.output}"
    assert "learning_rate" in result.stdout
    assert not (tmp_path / "prepared").exists()


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ("gradient_checkpointing_layers: 3\n", "`gradient_checkpointing_layers: 3`, but LlamaForCausalLM has 2"),
        ("activation_offload_layers: 3\n", "`activation_offload_layers: 3` offloads that many of the checkpointed"),
    ],
)
def test_validate_refuses_layer_counts_the_model_cannot_take(tmp_path, keys, needle):
    """The tiny Llama has 2 decoder layers; `validate` reads its structure, as `train` does, without loading it."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    body = dataset_entry(data, "chat_template") + "adapter: lora\ngradient_checkpointing: true\n"
    assert_user_error(invoke("validate", make_config(tmp_path, body + keys)), needle, "Set it to 2 or less")
    assert invoke("validate", make_config(tmp_path, body + keys.replace("3", "2"))).exit_code == 0


def test_validate_stays_offline_and_says_what_it_did_not_check(tmp_path, monkeypatch, caplog):
    """A hub id that is not in the local cache: nothing is downloaded, and the warning names the model."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))

    def no_network(*args, **kwargs):
        raise AssertionError("validate must not reach the hub")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    body = dataset_entry(data, "chat_template") + "gradient_checkpointing: true\ngradient_checkpointing_layers: 9\n"
    config = make_config(tmp_path, body).read_text().replace("hellbender/tiny-llama", "some-org/some-model")
    (tmp_path / "hub.yml").write_text(config)
    with caplog.at_level("WARNING", logger="hellbender"):
        result = invoke("validate", tmp_path / "hub.yml")
    assert result.exit_code == 0, result.output
    assert "were not checked against `some-org/some-model`, whose config is not on this machine" in caplog.text


def test_validate_reads_a_hub_models_layers_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub

    from hellbender.models.tiny import tiny_model_dir

    cache = tmp_path / "cache"
    snapshot = cache / "models--some-org--some-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_model_dir("hellbender/tiny-llama") / "config.json").read_text())
    (cache / "models--some-org--some-model" / "refs").mkdir()
    (cache / "models--some-org--some-model" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)
    body = dataset_entry(data, "chat_template") + "gradient_checkpointing: true\ngradient_checkpointing_layers: 9\n"
    config = make_config(tmp_path, body).read_text().replace("hellbender/tiny-llama", "some-org/some-model")
    (tmp_path / "hub.yml").write_text(config)
    assert_user_error(invoke("validate", tmp_path / "hub.yml"), "`gradient_checkpointing_layers: 9`, but")


def test_debug_shows_the_traceback(tmp_path):
    config = make_config(tmp_path, dataset_entry(tmp_path / "x.jsonl", "completion") + "learning_rat: 0.1\n")
    result = invoke("validate", config, "--debug")
    assert isinstance(result.exception, ConfigError)
    assert "learning_rat" in str(result.exception)
    assert result.exit_code != 0

    result = invoke("validate", config, env={"HELLBENDER_DEBUG": "1"})
    assert isinstance(result.exception, ConfigError)

    result = invoke("validate", config, env={"HELLBENDER_DEBUG": "0"})
    assert_user_error(result, "learning_rat")


def test_examples_lists_quickstart():
    result = invoke("examples")
    assert result.exit_code == 0, result.output
    assert "quickstart.yml" in result.stdout
    assert "Offline quickstart" in result.stdout


def test_examples_copies_config_and_data(tmp_path):
    dest = tmp_path / "my_examples"
    result = invoke("examples", "quickstart", "--dest", dest)
    assert result.exit_code == 0, result.output
    copied = yaml.safe_load((dest / "quickstart.yml").read_text())
    original = yaml.safe_load((EXAMPLES / "quickstart.yml").read_text())
    # Only the data paths change: they start from the copy's directory, where the user runs it.
    assert copied["datasets"][0].pop("path") == "data/chat.jsonl"
    original["datasets"][0].pop("path")
    assert copied == original
    assert f"cd {dest} && hellbender train quickstart.yml" in result.stdout
    copied = sorted(str(p.relative_to(dest / "data")) for p in (dest / "data").rglob("*") if p.is_file())
    assert copied == ["chat.jsonl"]  # only what the example uses
    assert (dest / "data" / "chat.jsonl").read_bytes() == (EXAMPLES / "data" / "chat.jsonl").read_bytes()


def test_a_copied_vlm_example_brings_the_images_its_rows_name(tmp_path, monkeypatch):
    dest = tmp_path / "vlm"
    assert invoke("examples", "tiny-vlm-shapes", "--dest", dest).exit_code == 0
    images = sorted(p.name for p in (dest / "data" / "shapes").iterdir())
    assert images == sorted(p.name for p in (EXAMPLES / "data" / "shapes").iterdir())
    monkeypatch.chdir(dest)
    assert invoke("validate", "tiny-vlm-shapes.yml").exit_code == 0


def test_examples_unknown_name(tmp_path):
    result = invoke("examples", "nope", "--dest", tmp_path / "x")
    assert result.exit_code == 2
    assert "no example `nope`" in result.output and "quickstart.yml" in result.output
    assert not (tmp_path / "x").exists()


EXAMPLE_CONFIGS = sorted(EXAMPLES.rglob("*.yml"))


def test_examples_exist():
    assert EXAMPLE_CONFIGS, f"no example configs under {EXAMPLES}"


@pytest.mark.parametrize("example", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_config_validates(example):
    result = invoke("validate", example)
    assert result.exit_code == 0, f"{result.exception!r}\n{result.output}"
    assert result.stdout.startswith(f"# valid: {example} (")


# ---------------------------------------------------------------- a real process


def test_real_process_prints_no_traceback(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n{not json}\n")
    config = make_config(tmp_path, dataset_entry(data, "completion"))
    proc = subprocess.run(
        [sys.executable, "-m", "hellbender", "preprocess", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "HELLBENDER_DEBUG"},
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr and "bad.jsonl" in proc.stderr and "line 2" in proc.stderr


def test_a_real_validate_of_a_clean_config_prints_the_verdict_and_nothing_else(tmp_path):
    """No library warning reaches a user on every command (bitsandbytes' CPU backend, imported with PEFT, warns
    about a hub kernel for 4-bit matmuls on CPU that hellbender never uses; with torchao installed, importing
    transformers' model code, as checking the layer counts does, logs its extensions' load failures and torch's
    deprecation of its Enum registrations; the tiny model's first build shows a progress bar)."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n")
    layer_counts = "gradient_checkpointing: true\ngradient_checkpointing_layers: 1\n"
    config = make_config(tmp_path, dataset_entry(data, "completion") + layer_counts)
    proc = subprocess.run(
        [sys.executable, "-m", "hellbender", "validate", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# valid:"), proc.stdout
    assert proc.stderr == "", proc.stderr
