"""MusicGen (`musicgen`, `musicgen_melody`): transformers lists their decoders among its causal language models,
but they predict audio, not text. Their input is several parallel streams of audio-codec codes (one embedding table
per codebook, `num_codebooks` rows of ids per example) and their head predicts every codebook at once; a text
tokenizer's ids and a row of text labels do not fit them (the first step fails inside the model). hellbender trains
text and image-text models, so the family is refused by name when its config is read."""

from __future__ import annotations

from typing import Any

from hellbender.errors import ConfigError

MODEL_TYPES = ("musicgen", "musicgen_decoder", "musicgen_melody", "musicgen_melody_decoder")


def refuse_audio_decoder(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return
    raise ConfigError(
        f"`base_model` is a `{model_type}` model, MusicGen's decoder of audio-codec codes: it reads "
        f"{getattr(config, 'num_codebooks', 'several')} streams of audio codes per example and predicts each "
        "codebook, not one stream of text tokens, so hellbender cannot train it on text. Choose a text model "
        "(Llama, Qwen, Gemma, GPT-2, ...)."
    )
