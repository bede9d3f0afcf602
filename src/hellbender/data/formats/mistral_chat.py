"""`type: chat_template` rows with `tokenizer_use_mistral_common`: mistral-common encodes the conversation itself
(its instruct format, no Jinja template), and only assistant turns and their EOS are trained.

mistral-common builds token ids directly and never renders text that could be re-tokenized, so turn boundaries
are found at the token level: each assistant turn's own tokens are the difference between the conversation
encoded up to that turn and up to the message before it. Every assistant turn ends with EOS, and EOS never comes
from text, so each turn is then found in the full encoding just before the next EOS. Where the tokens do not
line up (a format that moves earlier messages once later ones follow) the row is refused, never guessed at.
Vision rows (`mistral_multimodal_chat`) are encoded the same way, their user turns carrying opened images.
"""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError
from hellbender.data.formats.chat_template import (
    _train_eos,
    is_trained,
    read_messages,
    refuse_weights_with_train_on_inputs,
)


def is_mistral_common(tokenizer: Any) -> bool:
    """Whether `tokenizer` is transformers' `MistralCommonBackend` (checked by class name, so mistral-common is
    imported only by configs that use it)."""
    return any(cls.__name__ == "MistralCommonBackend" for cls in type(tokenizer).__mro__)


def _encoders(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's instruct format under both of mistral-common's validation modes: `finetuning` encodes a
    conversation that ends with an assistant turn (and its EOS), `test` one that ends with a prompt."""
    from mistral_common.protocol.instruct.normalize import get_normalizer
    from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    instruct = tokenizer.tokenizer.instruct_tokenizer
    version = instruct.tokenizer.version
    normalizer = get_normalizer(version, getattr(instruct.tokenizer, "model_settings_builder", None))
    return {
        mode: MistralTokenizer(instruct, validator=get_validator(version, mode=mode), request_normalizer=normalizer)
        for mode in (ValidationMode.finetuning, ValidationMode.test)
    }


def _message(message: dict[str, Any]) -> Any:
    """One message as mistral-common's own message object. A content of parts (vision-language rows) keeps its text
    and its opened images in order; the image encoder turns each image into its tokens and pixels."""
    from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk
    from mistral_common.protocol.instruct.converters import convert_openai_messages
    from mistral_common.protocol.instruct.messages import UserMessage

    content = message["content"]
    if not isinstance(content, list):
        return convert_openai_messages([message])[0]
    if message["role"] != "user":
        if any(part["type"] == "image" for part in content):
            raise RowError(f"a `{message['role']}` message holds an image; mistral-common takes images in user turns")
        return convert_openai_messages([{**message, "content": "".join(part["text"] for part in content)}])[0]
    return UserMessage(
        content=[ImageChunk(image=p["image"]) if p["type"] == "image" else TextChunk(text=p["text"]) for p in content]
    )


def _encode(encoders: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """mistral-common's encoding of `messages`: its `tokens`, and the `images` (C x H x W pixel arrays) of the
    image parts, which must be opened PIL images."""
    from mistral_common.exceptions import MistralCommonException
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from pydantic import ValidationError

    mode = ValidationMode.finetuning if messages and messages[-1]["role"] == "assistant" else ValidationMode.test
    try:
        request = ChatCompletionRequest(messages=[_message(m) for m in messages])
        return encoders[mode].encode_chat_completion(request)
    except (MistralCommonException, ValidationError, ValueError, AssertionError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RowError(
            f"mistral-common refuses this conversation: {reason} (it expects an optional system message, then user "
            "and assistant turns in order)"
        ) from None


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    ids, labels, _ = encode_conversation(read_messages(row, ctx), ctx)
    return {"input_ids": ids, "labels": labels}


def encode_conversation(messages: list[dict[str, Any]], ctx: FormatContext) -> tuple[list[int], list[int], list[Any]]:
    """The conversation's token ids, its labels (assistant turns and their EOS as `roles_to_train`, `train_on_eos`
    and `train_on_inputs` say) and the pixel arrays of its images, in order."""
    tokenizer = ctx.tokenizer
    if ctx.thinking_key and any(ctx.thinking_key in m for m in messages):
        raise RowError(
            f"the row's messages carry reasoning (`{ctx.thinking_field}`, `field_thinking`), and mistral-common "
            "encodes conversations without it, so it would be left out silently; write it into the content the "
            "way the model's format does, or remove it from the data"
        )
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        raise RowError(
            "the row holds tool calls or tool results, which hellbender does not yet encode with mistral-common "
            "(`tokenizer_use_mistral_common`); train such rows with the model's Jinja chat template instead"
        )
    if any(m["role"] != "assistant" and getattr(m, "train", None) for m in messages):
        raise RowError(
            "with mistral-common only assistant turns can be trained, but a message of another role is marked "
            "`weight: 1`; remove the weight, or train without `tokenizer_use_mistral_common`"
        )
    encoders = _encoders(tokenizer)
    encoded = _encode(encoders, messages)
    ids, images = list(encoded.tokens), list(encoded.images)
    if ctx.train_on_inputs:
        refuse_weights_with_train_on_inputs(messages)
        return ids, list(ids), images
    eos = tokenizer.eos_token_id
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last_trained = max((i for i in assistants if is_trained(messages[i], ctx)), default=-1)
    labels = [IGNORE_INDEX] * len(ids)
    cursor = 0
    for i in assistants:
        prompt = list(_encode(encoders, messages[:i]).tokens)
        turn = list(_encode(encoders, messages[: i + 1]).tokens)
        own = turn[len(prompt) :]
        end = ids.index(eos, cursor) if eos in ids[cursor:] else -1
        start = end + 1 - len(own)
        if turn[: len(prompt)] != prompt or not own or own[-1] != eos or start < cursor or ids[start : end + 1] != own:
            raise RowError(
                f"mistral-common encodes assistant message {i} differently once later messages follow (this "
                "tokenizer version moves earlier content, e.g. tool calls before the last user message), so its "
                "tokens cannot be located exactly; shorten the conversation to end at that turn, or pre-tokenize it"
            )
        trained = is_trained(messages[i], ctx)
        if trained:
            labels[start:end] = ids[start:end]
        if _train_eos(ctx.train_on_eos, trained, i == last_trained):
            labels[end] = eos
        cursor = end + 1
    return ids, labels, images
