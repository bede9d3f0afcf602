"""`type: chat_template`: conversations rendered with a chat template, training only chosen roles.

Turn boundaries come from the template itself: where each message's content lands in the rendered text is
found by rendering the conversation with placeholders, and token offsets decide which tokens belong to a
trained turn. The template's own headers (`<|im_start|>assistant` and the like) are therefore never
trained, whatever the model family, and no per-model token lists are needed. The end-of-turn token is the
special token right after a turn's content; `train_on_eos` decides when it is trained.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from hellbender.config.data import CHAT_ROLES
from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError
from hellbender.errors import ConfigError

# Each template role under its own name, and ShareGPT's names for them.
DEFAULT_ROLE_ALIASES = {
    **{role: role for role in CHAT_ROLES},
    "human": "user",
    "gpt": "assistant",
    "model": "assistant",
}


def read_messages(row: dict[str, Any], ctx: FormatContext, allow_parts: bool = False) -> list[dict[str, Any]]:
    """The row's conversation as `{"role", "content"}` messages with template role names.

    Content is a string, or (with `allow_parts`, for vision-language models) a list of parts such as
    `{"type": "text", "text": ...}` and `{"type": "image", "path": ...}`.
    """
    field = ctx.field_messages or ("messages" if "messages" in row else "conversations")
    if field not in row:
        if ctx.field_messages is None:
            raise RowError(
                f"there is no `messages` or `conversations` column: the conversation is missing (columns: "
                f"{', '.join(sorted(row))}); name the column that holds it with `field_messages`"
            )
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
            has = (
                f"it has keys {', '.join(sorted(map(str, message)))}"
                if isinstance(message, dict)
                else "it is not a mapping"
            )
            mapped = (
                "; `message_property_mappings` names them"
                if (ctx.role_key, ctx.content_key) != ("role", "content")
                else ""
            )
            raise RowError(f"message {i} needs `{role_key}` and `{content_key}` keys ({has}){mapped}")
        if not isinstance(message[role_key], str):
            raise RowError(f"message {i} has the role {message[role_key]!r}; a role must be text, e.g. `user`")
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
        if isinstance(content, list) and allow_parts:
            content = [_read_part(part, i) for part in content]
        elif not isinstance(content, str):
            hint = (
                " (image parts need `processor_type`, which selects a vision-language model)"
                if isinstance(content, list)
                else ""
            )
            raise RowError(f"message {i} content must be text, not {type(content).__name__}{hint}")
        if not (ctx.drop_system_message and role == "system"):
            messages.append({"role": role, "content": content})
    return messages


def _read_part(part: Any, message: int) -> dict[str, Any]:
    # Rows loaded through Arrow carry every key of every part type, the absent ones as None.
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise RowError(
            f"message {message} has a content part that is not `{{type: text}}` or `{{type: image}}`: {part!r}"
        )
    if part["type"] == "text":
        return {"type": "text", "text": part.get("text") or ""}
    return {"type": "image", **{k: v for k, v in part.items() if k != "type" and v is not None}}


Segment = tuple[int, str]  # (message index, text)


def text_segments(messages: list[dict[str, Any]]) -> list[Segment]:
    """Every piece of text the template renders, in message order: a string content is one segment, each
    text part of a list content another."""
    segments = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            segments.append((i, content))
        else:
            segments += [(i, part["text"]) for part in content if part["type"] == "text"]
    return segments


def _placeholder(k: int) -> str:
    # Letters and digits only, so templates that trim or escape content leave it intact; the trailing
    # letter keeps placeholder 1 from matching inside placeholder 10.
    return f"hbmsg{k}q"


def _with_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    k = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content, k = _placeholder(k), k + 1
        else:
            parts = []
            for part in content:
                if part["type"] == "text":
                    part, k = {"type": "text", "text": _placeholder(k)}, k + 1
                parts.append(part)
            content = parts
        out.append({**message, "content": content})
    return out


Render = Callable[[list[dict[str, Any]]], str]


def render_with_spans(render: Render, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int] | None]]:
    """The rendered conversation and the character span of each text segment (see `text_segments`) in it.

    The conversation is rendered a second time with every text replaced by a unique placeholder; where the
    placeholders land is exactly where the template puts each text, whatever markup it adds around it (so
    an answer such as "assistant" or "end" is never confused with the template's own text). The real
    rendering must equal the placeholder rendering with the texts put back (verbatim, or stripped for
    templates that trim); a template that rewrites content is refused rather than guessed at. Segments the
    template does not render get a span of None.
    """
    segments = text_segments(messages)
    text = render(messages)
    skeleton = render(_with_placeholders(messages))
    found = sorted((at, k) for k in range(len(segments)) if (at := skeleton.find(_placeholder(k))) >= 0)
    for strip in (False, True):
        pieces: list[str] = []
        spans: list[tuple[int, int] | None] = [None] * len(segments)
        length, cursor = 0, 0
        for at, k in found:
            content = segments[k][1].strip() if strip else segments[k][1]
            pieces.append(skeleton[cursor:at])
            length += at - cursor
            spans[k] = (length, length + len(content))
            pieces.append(content)
            length += len(content)
            cursor = at + len(_placeholder(k))
        pieces.append(skeleton[cursor:])
        if "".join(pieces) == text:
            return text, spans
    raise RowError(
        "the chat template does not render message contents verbatim (it rewrites or reorders them), so the "
        "trained tokens cannot be located exactly; use a template that inserts each message's content as is "
        "(`chat_template: chatml` or your own `chat_template_jinja`), or pre-tokenize the rows"
    )


def template_failure(exc: Exception) -> Exception:
    """The error to raise when rendering failed: a template that does not parse is wrong for every row (the
    config's to fix); anything else is this conversation's problem."""
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return ConfigError(
            f"The chat template is not valid Jinja: {str(exc.message).rstrip('.')} (template line {exc.lineno}). Fix "
            "`chat_template_jinja`, or choose another `chat_template` (`tokenizer_default`, `chatml`)."
        )
    return RowError(f"the chat template failed on this conversation: {exc}")


def tokenizer_renderer(tokenizer: Any, template: str | None) -> Render:
    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for bad conversations
            raise template_failure(exc) from None

    return render


def special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
    }


def conversation_labels(
    text: str,
    spans: list[tuple[int, int] | None],
    messages: list[dict[str, Any]],
    ids: list[int],
    offsets: list[tuple[int, int]],
    special: set[int],
    ctx: FormatContext,
    image_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Labels for the tokens of a rendered conversation: the trained roles' text, plus each turn's
    end-of-turn token as `train_on_eos` says; everything else is IGNORE_INDEX. `image_ids` are image
    placeholders, which may sit between a message's last text and its end-of-turn token.

    The end-of-turn token is the first special token after a message's text, or with `eot_tokens` the first of
    those (other special tokens before it are passed over)."""
    segments = text_segments(messages)
    trained = [m["role"] in ctx.roles_to_train for m in messages]
    for k, span in enumerate(spans):
        i, seg_text = segments[k]
        if span is None and trained[i] and seg_text:
            raise RowError(f"the chat template leaves out message {i} ({messages[i]['role']}), which is to be trained")
    rendered = [k for k, span in enumerate(spans) if span is not None]
    last_segment = {segments[k][0]: k for k in rendered}  # message -> its last rendered segment
    last_trained = max((i for i in last_segment if trained[i]), default=-1)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    labels = [IGNORE_INDEX] * len(ids)
    for k in rendered:
        i = segments[k][0]
        start, end = spans[k]
        # Tokens that overlap the text are trained (" The" may start on the space before the content).
        token = bisect.bisect_right(ends, start)
        while start < end and token < len(ids) and starts[token] < end:
            if trained[i]:
                labels[token] = ids[token]
            token += 1
        if last_segment[i] != k:
            continue
        # The end-of-turn marker: a special token right after the message's last text, with only whitespace or
        # the message's trailing images between (with `eot_tokens`: other special tokens too).
        markers = ctx.eot_ids or special
        while token < len(ids) and (
            ids[token] in image_ids
            or (ctx.eot_ids and ids[token] in special and ids[token] not in markers)
            or (ids[token] not in special and not text[starts[token] : ends[token]].strip())
        ):
            token += 1
        if token < len(ids) and ids[token] in markers and _train_eos(ctx.train_on_eos, trained[i], i == last_trained):
            labels[token] = ids[token]
    return labels


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    tok = ctx.tokenizer
    messages = read_messages(row, ctx)
    render = tokenizer_renderer(tok, ctx.chat_template)
    if ctx.train_on_inputs:
        ids = tok(render(messages), add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "labels": list(ids)}
    text, spans = render_with_spans(render, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = conversation_labels(text, spans, messages, enc["input_ids"], enc["offset_mapping"], special_ids(tok), ctx)
    return {"input_ids": enc["input_ids"], "labels": labels}


def _train_eos(mode: str, turn_trained: bool, is_last_trained: bool) -> bool:
    if mode == "all":
        return True
    if mode == "turn":
        return turn_trained
    if mode == "last":
        return is_last_trained
    return False
