"""Conversations for generation: messages in the shape the model's chat template expects, the prompt it renders,
and the tokens that end an answer."""

from __future__ import annotations

import logging
from typing import Any

from hellbender.data.formats.base import special_token_ids

logger = logging.getLogger("hellbender")
# Rendered as an assistant turn to find what the template writes after an answer; plain letters, one word.
_ANSWER_MARKER = "hbanswerq"


def user_message(text: str, images: int, multimodal: bool) -> dict[str, Any]:
    """A user turn; a vision-language model's carries its images before the text, as in the training rows."""
    if not multimodal:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*([{"type": "image"}] * images), {"type": "text", "text": text}]}


def text_message(role: str, text: str, multimodal: bool) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}] if multimodal else text}


def render_prompt(template_owner: Any, messages: list[dict[str, Any]]) -> str:
    """The conversation as the chat template writes it, ending with the header of the assistant's next turn.
    `template_owner` is the processor of a vision-language model, otherwise the tokenizer."""
    return template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def end_of_turn_id(tokenizer: Any, template_owner: Any, multimodal: bool) -> int | None:
    """The special token the chat template writes right after an assistant's answer (`<|im_end|>`,
    `<end_of_turn>`, ...), found the way training finds the end-of-turn token it trains; None if there is none."""
    messages = [text_message("user", "hi", multimodal), text_message("assistant", _ANSWER_MARKER, multimodal)]
    try:
        text = template_owner.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for conversations it refuses
        logger.warning(
            "The chat template could not render a plain user / assistant exchange (%s: %s), so its end-of-turn token "
            "is unknown: generation stops only at the end-of-sequence token.",
            type(exc).__name__,
            exc,
        )
        return None
    if _ANSWER_MARKER not in text:
        return None
    rest = text[text.rindex(_ANSWER_MARKER) + len(_ANSWER_MARKER) :]
    special = special_token_ids(tokenizer)
    for token in tokenizer(rest, add_special_tokens=False)["input_ids"]:
        if token in special:
            return token
        if tokenizer.decode([token]).strip():  # text before any special token: the template has no end marker
            return None
    return None


def stop_token_ids(tokenizer: Any, template_owner: Any, multimodal: bool, generation_config: Any) -> list[int]:
    """Tokens that end generation: the model's own end-of-sequence ids, the tokenizer's EOS and the template's
    end-of-turn token (a model fine-tuned on a chat template learns to end its answer with that)."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids += [tokenizer.eos_token_id, end_of_turn_id(tokenizer, template_owner, multimodal)]
    return list(dict.fromkeys(i for i in ids if i is not None))
