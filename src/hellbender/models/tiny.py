"""Built-in tiny models (`base_model: hellbender/tiny-llama`, ...) for the offline quickstart and the tests.

They are built from a config with a fixed seed and saved like any hub checkpoint, so they load through
exactly the same code path as a real model id or local directory.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from hellbender.chat_templates import CHATML_TEMPLATE
from hellbender.storage import write_directory_atomically

TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Bump when an architecture, seed or the tokenizer changes so cached builds are not reused.
TINY_VERSION = 1
# name -> "module:function" building the model into a directory (imported only when that model is used).
TINY_MODELS: dict[str, str] = {
    "hellbender/tiny-llama": "hellbender.models.tiny:build_tiny_llama",
    "hellbender/tiny-gemma4": "hellbender.models.tiny_vlm.gemma4:build_text",
    "hellbender/tiny-gemma4-vlm": "hellbender.models.tiny_vlm.gemma4:build",
    "hellbender/tiny-qwen2.5-vl": "hellbender.models.tiny_vlm.qwen2_5_vl:build",
    "hellbender/tiny-qwen3-vl": "hellbender.models.tiny_vlm.qwen3_vl:build",
    "hellbender/tiny-llava": "hellbender.models.tiny_vlm.llava:build",
    "hellbender/tiny-idefics3": "hellbender.models.tiny_vlm.idefics3:build",
}


def is_tiny_model(name: str) -> bool:
    return name in TINY_MODELS


def cache_root() -> Path:
    return Path(os.environ.get("HELLBENDER_CACHE", Path.home() / ".cache" / "hellbender"))


def build_tiny_tokenizer(
    extra_special_tokens: Sequence[str] = (), chat_template: str = CHATML_TEMPLATE, **named_special_tokens: str
):
    """The tiny byte-level BPE tokenizer (512 tokens + specials). VLM builders add their image tokens through
    `extra_special_tokens` and name them (`image_token="<image>"`, ...) through keyword arguments."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", *extra_special_tokens]
    specials += [t for t in named_special_tokens.values() if t not in specials]
    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials,
        chat_template=chat_template,
        model_max_length=2048,
        **named_special_tokens,
    )


# The decoder shape every tiny model shares (the tiny Llama, and the language model of the tiny VLMs).
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def tiny_decoder_config(tokenizer, eos_token_id: int | None = None) -> dict:
    """Keyword arguments of a tiny decoder config for `tokenizer` (untied embeddings, no BOS)."""
    return dict(
        vocab_size=len(tokenizer),
        **TINY_DECODER,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id if eos_token_id is None else eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_llama(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(**tiny_decoder_config(tokenizer))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)


def _builder(name: str) -> Callable[[Path], None]:
    module, function = TINY_MODELS[name].split(":")
    return getattr(importlib.import_module(module), function)


def tiny_model_dir(name: str) -> Path:
    """Directory holding the saved tiny model, built on first use (whole or not at all)."""
    target = cache_root() / "models" / f"{name.split('/')[-1]}-v{TINY_VERSION}"
    if _is_built(target):
        return target

    def build(staging: Path) -> None:
        import torch
        from transformers.utils import logging as transformers_logging

        # No "Writing model shards" bar for a model of a few megabytes built behind the user's command.
        bars_were_on = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            with torch.random.fork_rng(devices=[]):  # builders seed their own init; the caller's RNG stays as it was
                _builder(name)(staging)
        finally:
            if bars_were_on:
                transformers_logging.enable_progress_bar()

    return write_directory_atomically(target, build, keep_if=_is_built)  # another process may build it meanwhile


def _is_built(directory: Path) -> bool:
    return (directory / "config.json").is_file()
