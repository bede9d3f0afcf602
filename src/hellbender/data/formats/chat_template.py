"""`type: chat_template`: conversations rendered with a chat template, training only chosen roles.

Turn boundaries come from the template itself: where each message's content lands in the rendered text is
found by rendering the conversation with placeholders, and token offsets decide which tokens belong to a
trained turn. The template's own headers (`<|im_start|>assistant` and the like) are therefore never
trained, whatever the model family, and no per-model token lists are needed. The end-of-turn token is the
special token right after a turn's content; `train_on_eos` decides when it is trained.
"""

from __future__ import annotations

import bisect
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


def _render(tokenizer: Any, template: str | None, messages: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for bad conversations
        raise RowError(f"the chat template failed on this conversation: {exc}") from None


def _placeholder(i: int) -> str:
    # Letters and digits only, so templates that trim or escape content leave it intact; the trailing
    # letter keeps placeholder 1 from matching inside placeholder 10.
    return f"hbmsg{i}q"


def render_with_spans(tokenizer: Any, template: str | None, messages: list[dict[str, str]]):
    """The rendered conversation and the character span of each message's content in it.

    The conversation is rendered a second time with every content replaced by a unique placeholder; where
    the placeholders land is exactly where the template puts each content, whatever text the template adds
    around it (so an answer such as "assistant" or "end" is never confused with the template's markup).
    The real rendering must equal the placeholder rendering with the contents put back (verbatim, or
    stripped for templates that trim); a template that rewrites content is refused rather than guessed at.
    Messages the template does not render get a span of None.
    """
    text = _render(tokenizer, template, messages)
    skeleton = _render(tokenizer, template, [{**m, "content": _placeholder(i)} for i, m in enumerate(messages)])
    found = sorted((at, i) for i in range(len(messages)) if (at := skeleton.find(_placeholder(i))) >= 0)
    for strip in (False, True):
        pieces: list[str] = []
        spans: list[tuple[int, int] | None] = [None] * len(messages)
        length, cursor = 0, 0
        for at, i in found:
            content = messages[i]["content"].strip() if strip else messages[i]["content"]
            pieces.append(skeleton[cursor:at])
            length += at - cursor
            spans[i] = (length, length + len(content))
            pieces.append(content)
            length += len(content)
            cursor = at + len(_placeholder(i))
        pieces.append(skeleton[cursor:])
        if "".join(pieces) == text:
            return text, spans
    raise RowError(
        "the chat template does not render message contents verbatim (it rewrites or reorders them), so the "
        "trained tokens cannot be located exactly; use a template that inserts each message's content as is "
        "(`chat_template: chatml` or your own `chat_template_jinja`), or pre-tokenize the rows"
    )


def _special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
    }


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    tok = ctx.tokenizer
    messages = read_messages(row, ctx)
    if ctx.train_on_inputs:
        ids = tok(_render(tok, ctx.chat_template, messages), add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "labels": list(ids)}
    text, spans = render_with_spans(tok, ctx.chat_template, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    starts = [s for s, _ in enc["offset_mapping"]]
    ends = [e for _, e in enc["offset_mapping"]]
    special = _special_ids(tok)
    trained = [m["role"] in ctx.roles_to_train for m in messages]
    for i, span in enumerate(spans):
        if span is None and trained[i] and messages[i]["content"]:
            raise RowError(f"the chat template leaves out message {i} ({messages[i]['role']}), which is to be trained")
    last_trained = max((i for i, t in enumerate(trained) if t and spans[i] is not None), default=-1)
    labels = [IGNORE_INDEX] * len(ids)
    for i, span in enumerate(spans):
        if span is None:
            continue
        start, end = span
        # Tokens that overlap the content are trained (" The" may start on the space before the content).
        token = bisect.bisect_right(ends, start)
        while start < end and token < len(ids) and starts[token] < end:
            if trained[i]:
                labels[token] = ids[token]
            token += 1
        # The end-of-turn marker: a special token right after the content (only whitespace between).
        while token < len(ids) and ids[token] not in special and not text[starts[token] : ends[token]].strip():
            token += 1
        at_end = token < len(ids) and ids[token] in special
        if at_end and _train_eos(ctx.train_on_eos, trained[i], i == last_trained):
            labels[token] = ids[token]
    return {"input_ids": ids, "labels": labels}


def _train_eos(mode: str, turn_trained: bool, is_last_trained: bool) -> bool:
    if mode == "all":
        return True
    if mode == "turn":
        return turn_trained
    if mode == "last":
        return is_last_trained
    return False
