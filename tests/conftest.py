"""Shared fixtures. Tests never touch the network: hub access is switched off and caches live in tmp dirs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.tiny_vlms import TINY_VLMS, TinyVLM

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


# --- the built-in tiny VLMs (tests/tiny_vlms.py), one parameter per family ---------------------------------------
# Module scope keeps pytest from reordering tests across modules to group families. A module about one family
# narrows the parameter: `pytestmark = pytest.mark.parametrize("tiny_vlm", ["llava"], indirect=True)`.


@pytest.fixture(scope="module", params=list(TINY_VLMS))
def tiny_vlm(request) -> TinyVLM:
    """The family's record (tests/tiny_vlms.py)."""
    return TINY_VLMS[request.param]


@pytest.fixture(scope="module")
def tiny_vlm_dir(tiny_vlm) -> Path:
    """The saved tiny VLM, built by its registered builder (TINY_MODELS) once per session: the directory that
    `base_model: hellbender/tiny-...` loads from."""
    from hellbender.models.tiny import tiny_model_dir

    return tiny_model_dir(tiny_vlm.name)


@pytest.fixture(scope="module")
def tiny_vlm_processor(tiny_vlm, tiny_vlm_dir):
    return tiny_vlm.load_processor(tiny_vlm_dir)


@pytest.fixture(scope="module")
def tiny_vlm_model(tiny_vlm_dir):
    """The model in evaluation mode (fp32), shared by a module's tests: a test that runs backward zeroes the
    gradients before and after."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()


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
