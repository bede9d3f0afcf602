"""Built-in tiny models (`base_model: hellbender/tiny-llama`) for the offline quickstart and the tests.

They are built from a config with a fixed seed and saved like any hub checkpoint, so they load through
exactly the same code path as a real model id or local directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hellbender.chat_templates import CHATML_TEMPLATE

TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Bump when the architecture, seed or tokenizer changes so cached builds are not reused.
TINY_VERSION = 1
TINY_MODELS = {
    "hellbender/tiny-llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}


def is_tiny_model(name: str) -> bool:
    return name in TINY_MODELS


def cache_root() -> Path:
    return Path(os.environ.get("HELLBENDER_CACHE", Path.home() / ".cache" / "hellbender"))


def build_tiny_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def tiny_model_dir(name: str) -> Path:
    """Directory holding the saved tiny model, built on first use (atomically: temp dir, then rename)."""
    target = cache_root() / "models" / f"{name.split('/')[-1]}-v{TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **TINY_MODELS[name],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target) if not target.exists() else shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
