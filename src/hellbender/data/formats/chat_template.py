"""`type: chat_template`: conversations rendered with a chat template, training only chosen roles.

Turn boundaries come from the template itself: the conversation is rendered once, each message's content
is located in the rendered text in order, and token offsets decide which tokens belong to a trained turn.
The template's own headers (`<|im_start|>assistant` and the like) are therefore never trained, whatever
the model family, and no per-model token lists are needed. The end-of-turn token is the first special
token after a turn's content; `train_on_eos` decides when it is trained.
"""

from __future__ import annotations

from typing import Any

from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError

DEFAULT_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
}


def read_messages(row: dict[str, Any], ctx: FormatContext) -> list[dict[str, str]]:
    field = ctx.field_messages or ("messages" if "messages" in row else "conversations")
    if field not in row:
        raise RowError(f"column `{field}` with the conversation is missing (columns: {', '.join(sorted(row))})")
    raw = row[field]
    if not isinstance(raw, list) or not raw:
        raise RowError(f"column `{field}` must be a non-empty list of messages")
    role_map = ctx.role_map or DEFAULT_ROLE_ALIASES
    role_key, content_key = ctx.role_key, ctx.content_key
    if ctx.role_key == "role" and "role" not in raw[0] and "from" in raw[0]:
        role_key, content_key = "from", "value"  # ShareGPT layout
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise RowError(f"message {i} needs `{role_key}` and `{content_key}` keys")
        role = role_map.get(message[role_key])
        if role is None:
            name = message[role_key]
            known = ", ".join(sorted(role_map))
            raise RowError(
                f"message {i} has unknown role `{name}`; known roles: {known}. Map it onto a template role with "
                f"the dataset's `roles:` key, e.g. `roles: {{assistant: [{name}]}}`"
            )
        content = message[content_key]
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RowError(f"message {i} content must be text, not {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def _locate_contents(text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
    """Character span of each message's content in the rendered conversation, searched in order."""
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        start = text.find(content, cursor) if content else -1
        if start < 0 and content.strip():
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:
            if content.strip():
                raise RowError(
                    f"the chat template does not render message {i} ({message['role']}) verbatim, so its tokens "
                    "cannot be located; check the template or the message text"
                )
            spans.append((cursor, cursor))
            continue
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def _special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
    }


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    tok = ctx.tokenizer
    messages = read_messages(row, ctx)
    try:
        text = tok.apply_chat_template(messages, chat_template=ctx.chat_template, tokenize=False)
    except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for bad conversations
        raise RowError(f"the chat template failed on this conversation: {exc}") from None
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    starts = [s for s, _ in enc["offset_mapping"]]
    ends = [e for _, e in enc["offset_mapping"]]
    if ctx.train_on_inputs:
        return {"input_ids": ids, "labels": list(ids)}

    spans = _locate_contents(text, messages)
    special = _special_ids(tok)
    trained = [m["role"] in ctx.roles_to_train for m in messages]
    last_trained = max((i for i, t in enumerate(trained) if t), default=-1)
    labels = [IGNORE_INDEX] * len(ids)
    token = 0
    for i, (start, end) in enumerate(spans):
        next_start = spans[i + 1][0] if i + 1 < len(spans) else len(text) + 1
        # A token is part of the content if it overlaps it (" The" may start on the space before it).
        while token < len(ids) and ends[token] <= start:
            token += 1
        while start < end and token < len(ids) and starts[token] < end:
            if trained[i]:
                labels[token] = ids[token]
            token += 1
        # The end-of-turn marker: the first special token after the content, before the next message.
        eot = token
        while eot < len(ids) and starts[eot] < next_start and ids[eot] not in special:
            eot += 1
        if eot < len(ids) and starts[eot] < next_start and _train_eos(ctx.train_on_eos, trained[i], i == last_trained):
            labels[eot] = ids[eot]
    return {"input_ids": ids, "labels": labels}


def _train_eos(mode: str, turn_trained: bool, is_last_trained: bool) -> bool:
    if mode == "all":
        return True
    if mode == "turn":
        return turn_trained
    if mode == "last":
        return is_last_trained
    return False
