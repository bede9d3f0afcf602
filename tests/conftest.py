"""Shared fixtures. Tests never touch the network: hub access is switched off and caches live in tmp dirs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="hellbender-tests-"))
os.environ.setdefault("HELLBENDER_CACHE", str(_SESSION_TMP / "hellbender-cache"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_TMP / "hf-datasets")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "src" / "hellbender" / "examples"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def libraries_log_to_the_session_stderr():
    """For modules that invoke the CLI in-process (`pytestmark = pytest.mark.usefixtures(...)`): `datasets` and
    `transformers` bind their log handlers to whatever sys.stderr is when they are first imported. Imported inside a
    CliRunner call, that is the runner's stream, which is closed afterwards, and every later log line prints
    "--- Logging error --- Traceback ..." into the next test's output."""
    import datasets  # noqa: F401
    import transformers  # noqa: F401


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The built-in tiny model's tokenizer (ChatML template, EOS `<|endoftext|>`, pad `<|pad|>`)."""
    from hellbender.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Directory of the saved tiny Llama, built once per session by the same factory users get."""
    from hellbender.models.tiny import tiny_model_dir

    return tiny_model_dir("hellbender/tiny-llama")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def trained_text_lora(tmp_path_factory):
    """A finished LoRA run of the tiny Llama (tests/trained_runs.py), shared by the tests of what follows training."""
    from tests.trained_runs import train_text_lora

    return train_text_lora(tmp_path_factory.mktemp("trained-text-lora"))


@pytest.fixture(scope="session")
def trained_vlm_lora(tmp_path_factory):
    """A finished LoRA run of the tiny Qwen2.5-VL (tests/trained_runs.py)."""
    from tests.trained_runs import train_vlm_lora

    return train_vlm_lora(tmp_path_factory.mktemp("trained-vlm-lora"))
