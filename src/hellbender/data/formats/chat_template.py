"""`type: chat_template`: conversations rendered with a chat template, training only chosen roles.

Turn boundaries come from the template itself: where each message's content lands in the rendered text is
found by rendering the conversation with placeholders, and token offsets decide which tokens belong to a
trained turn. The template's own headers (`<|im_start|>assistant` and the like) are therefore never
trained, whatever the model family, and no per-model token lists are needed. The end-of-turn token is the
special token right after a turn's content; `train_on_eos` decides when it is trained.

An assistant message may carry reasoning: the dataset's `field_thinking`, handed to the template under
`template_thinking_key` (gpt-oss's template reads `thinking` and writes it in the analysis channel), or a
`<think>...</think>` block written at the start of its content, which thinking templates (Qwen3) move into their own
block. Reasoning is located like content and trained with its message, together with the template's markup between
the reasoning and the answer (the model must learn to close its reasoning and open the answer).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from hellbender.config.data import CHAT_ROLES
from hellbender.data.formats.base import IGNORE_INDEX, FormatContext, RowError, special_ids_of
from hellbender.data.formats.placeholder_memo import Render, remembered
from hellbender.data.formats.render_budget import RenderBudgetExceeded, render_within_budget
from hellbender.data.formats.tool_calls import read_tool_calls, read_tools
from hellbender.errors import ConfigError

# Each template role under its own name, and ShareGPT's names for them.
DEFAULT_ROLE_ALIASES = {
    **{role: role for role in CHAT_ROLES},
    "human": "user",
    "gpt": "assistant",
    "model": "assistant",
}


class Turn(dict):
    """A message as the template receives it, plus whether its turn is trained when the dataset says so per message
    (`weight: 0` / `1`; None: `roles_to_train` decides). The flag is an attribute, so the template never sees it."""

    train: bool | None = None


WEIGHT_KEY = "weight"  # per message: 0 leaves the turn untrained, 1 trains it, whatever its role
# Message keys handed to the template as they are when present (tool messages name the call they answer).
PASSED_KEYS = ("name", "tool_call_id")


def read_messages(row: dict[str, Any], ctx: FormatContext, allow_parts: bool = False) -> list[dict[str, Any]]:
    """The row's conversation as `{"role", "content"}` messages with template role names (`Turn`s), an assistant's
    `tool_calls` and a tool message's `name` / `tool_call_id` kept for the template.

    Content is a string, or (with `allow_parts`, for vision-language models) a list of parts such as
    `{"type": "text", "text": ...}` and `{"type": "image", "path": ...}`. `content: null` is refused, except in an
    assistant message with `tool_calls`, where it means the turn is only the calls.
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
    if ctx.role_key == "role" and isinstance(raw[0], dict) and "role" not in raw[0] and "from" in raw[0]:
        role_key, content_key = "from", "value"  # ShareGPT layout
    messages = []
    for i, message in enumerate(raw):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(message, dict) or role_key not in message or (content_key not in message and not calls):
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
        content = message.get(content_key)
        if calls is not None:
            calls = read_tool_calls(calls, i, role)
        if content is None:
            if not calls:
                raise RowError(
                    f"message {i} ({role}) has `{content_key}: null`, which says nothing to train or show; write "
                    f'`{content_key}: ""` for an empty turn, or remove the message'
                )
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
            turn = Turn(role=role, content=content, **_reasoning_of(message, i, ctx))
            if calls:
                turn["tool_calls"] = calls
            for key in PASSED_KEYS:
                if isinstance(message.get(key), str):
                    turn[key] = message[key]
            turn.train = _weight_of(message, i)
            messages.append(turn)
    return messages


def _weight_of(message: dict[str, Any], i: int) -> bool | None:
    """The message's `weight` as a training decision: 0 no, 1 yes, absent (or null) leaves it to `roles_to_train`."""
    weight = message.get(WEIGHT_KEY)
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight not in (0, 1):
        raise RowError(
            f"message {i} has `{WEIGHT_KEY}: {weight!r}`; a message's weight is 0 (its turn is not trained) or 1 (it "
            "is trained); weights between are not supported"
        )
    return weight == 1


def is_trained(message: dict[str, Any], ctx: FormatContext) -> bool:
    """Whether a message's turn is trained: its `weight` when given, else whether its role is in `roles_to_train`."""
    train = getattr(message, "train", None)
    return message["role"] in ctx.roles_to_train if train is None else train


def _reasoning_of(message: dict[str, Any], i: int, ctx: FormatContext) -> dict[str, str]:
    """The message's reasoning (`field_thinking`) under the template's name for it (`template_thinking_key`)."""
    if not ctx.thinking_field or message.get(ctx.thinking_field) is None:
        return {}
    reasoning = message[ctx.thinking_field]
    if not isinstance(reasoning, str):
        raise RowError(
            f"message {i} has `{ctx.thinking_field}` (its reasoning, `field_thinking`) of type "
            f"{type(reasoning).__name__}; it must be text"
        )
    return {ctx.thinking_key: reasoning}


def _read_part(part: Any, message: int) -> dict[str, Any]:
    # Rows loaded through Arrow carry every key of every part type, the absent ones as None.
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise RowError(
            f"message {message} has a content part that is not `{{type: text}}` or `{{type: image}}`: {part!r}"
        )
    if part["type"] == "text":
        return {"type": "text", "text": part.get("text") or ""}
    return {"type": "image", **{k: v for k, v in part.items() if k != "type" and v is not None}}


@dataclass(frozen=True)
class Segment:
    """A piece of text the template renders: a message's string content, one text part of a list content, the
    message's reasoning (its `template_thinking_key`, or a think block split out of its content), or the text the
    template writes for the message's tool calls (markup included: the model writes it all)."""

    message: int
    text: str
    reasoning: bool = False
    tool_calls: bool = False


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _think_block(content: str) -> tuple[int, int, int] | None:
    """Where a think block written in `content` sits: (start of its text, end of its text, start of the answer)."""
    close = content.find(THINK_CLOSE)
    if close < 0:
        return None
    opened = content.rfind(THINK_OPEN, 0, close)
    return (opened + len(THINK_OPEN) if opened >= 0 else 0), close, close + len(THINK_CLOSE)


def _placeholder(k: int) -> str:
    # Letters and digits only, so templates that trim or escape content leave it intact; the trailing
    # letter keeps placeholder 1 from matching inside placeholder 10.
    return f"hbmsg{k}q"


def layout(
    messages: list[dict[str, Any]], thinking_key: str | None = None, split_think: bool = False
) -> tuple[list[Segment], list[dict[str, Any]]]:
    """Every text the template renders, in message order, and the conversation with each of those texts replaced by
    a unique placeholder (built together so the two always agree). With `split_think`, a think block written in a
    string content is two segments, its reasoning and the answer after it, with the tags kept in place so that a
    template that moves the block still finds it."""
    segments: list[Segment] = []
    skeleton: list[dict[str, Any]] = []

    def hole(message: int, text: str, reasoning: bool = False) -> str:
        segments.append(Segment(message, text, reasoning))
        return _placeholder(len(segments) - 1)

    for i, message in enumerate(messages):
        out = dict(message)
        if thinking_key and isinstance(message.get(thinking_key), str):
            out[thinking_key] = hole(i, message[thinking_key], reasoning=True)
        content = message["content"]
        if content == "" and message.get("tool_calls"):
            pass  # a turn that is only tool calls: templates test the content before writing it
        elif isinstance(content, str):
            block = _think_block(content) if split_think else None
            if block is None:
                out["content"] = hole(i, content)
            else:
                begin, end, answer = block
                reasoning = hole(i, content[begin:end], reasoning=True)
                out["content"] = content[:begin] + reasoning + content[end:answer] + hole(i, content[answer:])
        else:
            out["content"] = [
                {"type": "text", "text": hole(i, part["text"])} if part["type"] == "text" else part for part in content
            ]
        skeleton.append(out)
    return segments, skeleton


Located = list[tuple[Segment, tuple[int, int] | None]]


def render_with_spans(
    render: Render,
    messages: list[dict[str, Any]],
    thinking_key: str | None = None,
    render_placeholders: Render | None = None,
) -> tuple[str, Located]:
    """The rendered conversation, and each text segment (see `layout`) with its character span in it.

    The conversation is rendered a second time with every text replaced by a unique placeholder; where the
    placeholders land is exactly where the template puts each text, whatever markup it adds around it (so
    an answer such as "assistant" or "end" is never confused with the template's own text). The real
    rendering must equal the placeholder rendering with the texts put back (verbatim, or stripped for
    templates that trim); a template that rewrites content is refused rather than guessed at. A think block
    written in a content is first taken as part of the content, and split out only when the template rewrites it
    (thinking templates move it into their own block). Segments the template does not render get a span of None.

    `render_placeholders`, when given, renders the placeholder conversations instead of `render` (a memo of it:
    `placeholder_memo.remembered`); should its texts not fit the real rendering, `render` renders them again.
    """
    text = render(messages)
    located = None
    if render_placeholders is not None:
        located = _locate(text, messages, thinking_key, render_placeholders)
    if located is None:
        located = _locate(text, messages, thinking_key, render)
    if located is None:
        raise RowError(
            "the chat template does not render message contents verbatim (it rewrites or reorders them), so the "
            "trained tokens cannot be located exactly; use a template that inserts each message's content as is "
            "(`chat_template: chatml` or your own `chat_template_jinja`), or pre-tokenize the rows"
        )
    return text, located


def _locate(text: str, messages: list[dict[str, Any]], thinking_key: str | None, render: Render) -> Located | None:
    """Each segment's span in `text` (see `render_with_spans`), with `render` rendering the placeholder
    conversations; None when no placeholder rendering, with the texts put back, equals `text`."""
    think_blocks = any(isinstance(m["content"], str) and THINK_CLOSE in m["content"] for m in messages)
    for split_think in (False, True) if think_blocks else (False,):
        segments, placeholders = layout(messages, thinking_key, split_think)
        skeleton = render(placeholders)
        found = sorted((at, k) for k in range(len(segments)) if (at := skeleton.find(_placeholder(k))) >= 0)
        for strip in (False, True):
            spans = _filled_spans(text, skeleton, segments, found, strip)
            if spans is None:
                continue
            located = list(zip(segments, spans, strict=True))
            _check_reasoning_rendered(render, messages, located, thinking_key, split_think)
            holes = [(at, at + len(_placeholder(k)), spans[k]) for at, k in found]
            located += _tool_call_spans(render, placeholders, skeleton, holes, text)
            return located
    return None


def _filled_spans(
    text: str, skeleton: str, segments: list[Segment], found: list[tuple[int, int]], strip: bool
) -> list[tuple[int, int] | None] | None:
    """Each segment's span in `text` when `text` is `skeleton` with the placeholders `found` (their positions and
    segment numbers, in order) replaced by their segments' texts (stripped with `strip`), else None."""
    pieces: list[str] = []
    spans: list[tuple[int, int] | None] = [None] * len(segments)
    length, cursor = 0, 0
    for at, k in found:
        content = segments[k].text.strip() if strip else segments[k].text
        pieces.append(skeleton[cursor:at])
        length += at - cursor
        spans[k] = (length, length + len(content))
        pieces.append(content)
        length += len(content)
        cursor = at + len(_placeholder(k))
    pieces.append(skeleton[cursor:])
    return spans if "".join(pieces) == text else None


def _tool_call_spans(
    render: Render,
    placeholders: list[dict[str, Any]],
    skeleton: str,
    holes: list[tuple[int, int, tuple[int, int]]],
    text: str,
) -> Located:
    """Where the template writes each assistant message's tool calls: the text that appears in the placeholder
    rendering when the message has its calls and not without them. `holes` maps placeholders (their start and end in
    `skeleton`) to the spans of their texts in `text`. A template that writes nothing for the calls is refused: the
    calls would vanish from training."""

    def in_text(at: int) -> int:
        shift = 0
        for start, end, (_, text_end) in holes:
            if end <= at:
                shift = text_end - end
            elif start < at:
                return text_end  # inside a placeholder: the calls start or end with the text
        return at + shift

    out: Located = []
    for i, message in enumerate(placeholders):
        if not message.get("tool_calls"):
            continue
        without = [
            m if k != i else {key: v for key, v in m.items() if key != "tool_calls"} for k, m in enumerate(placeholders)
        ]
        try:
            other = render(without)
        except (RowError, ConfigError):
            other = None
        if other is None or other == skeleton:
            raise RowError(
                f"the chat template does not render the tool calls of message {i} ({message['role']}): they would "
                "vanish from training; use a template that renders `tool_calls` (the model's own, "
                "`chat_template: tokenizer_default`, when it supports tools), or write the calls into the content"
            )
        # The common end first: what follows the calls is the turn's end marker, which rarely repeats the calls'
        # last character, while the header before them often shares their first (`assistant\n` + `\n<tool_call>`).
        suffix = 0
        while suffix < min(len(skeleton), len(other)) and skeleton[-1 - suffix] == other[-1 - suffix]:
            suffix += 1
        prefix = 0
        while prefix < min(len(skeleton), len(other)) - suffix and skeleton[prefix] == other[prefix]:
            prefix += 1
        start, end = in_text(prefix), in_text(len(skeleton) - suffix)
        out.append((Segment(i, text[start:end], tool_calls=True), (start, end)))
    return out


def _check_reasoning_rendered(
    render: Render, messages: list[dict[str, Any]], located: Located, thinking_key: str | None, split_think: bool
) -> None:
    """Refuse reasoning that the template never renders. Templates may leave out the reasoning of earlier turns
    (gpt-oss and Qwen3 keep only the last answer's), so a row none of whose reasoning is rendered is checked again
    ending at its last message with reasoning: if the template leaves it out there too, it never renders it."""
    reasoning = [seg for seg, _ in located if seg.reasoning and seg.text.strip()]
    if not reasoning or any(span is not None for seg, span in located if seg.reasoning):
        return
    last = max(seg.message for seg in reasoning)
    segments, placeholders = layout(messages[: last + 1], thinking_key, split_think)
    try:
        skeleton = render(placeholders)
    except (RowError, ConfigError):
        return  # the shortened conversation is not one this template takes; the full row rendered fine
    if any(_placeholder(k) in skeleton for k, seg in enumerate(segments) if seg.reasoning and seg.message == last):
        return
    if split_think:
        raise ConfigError(
            "The chat template drops the `<think>` block written at the start of assistant contents, even in a "
            "conversation's last message, so that reasoning would be left out of training silently. Choose a "
            "template that keeps it (`qwen3`, `chatml`), or remove the think blocks from the data."
        )
    raise ConfigError(
        f"The chat template never renders an assistant message's reasoning (given to it as `{thinking_key}`, set "
        "by `template_thinking_key`), not even in a conversation's last message, so the reasoning in the data would "
        "be left out of training silently. Set `template_thinking_key` to the name the template reads (gpt-oss's "
        "template reads `thinking`, Qwen3's `reasoning_content`), choose a template that renders reasoning, or "
        "remove the reasoning from the data (`field_thinking` names the message key it is read from)."
    )


def template_failure(exc: Exception, source: str = "`chat_template`") -> Exception:
    """The error to raise when rendering failed: a template that does not parse or does not finish within its budget
    is wrong for every row (the config's to fix; `source` names where the template came from); anything else is this
    conversation's problem."""
    from jinja2 import TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return ConfigError(
            f"The chat template is not valid Jinja: {str(exc.message).rstrip('.')} (template line {exc.lineno}). Fix "
            "`chat_template_jinja`, or choose another `chat_template` (`tokenizer_default`, `chatml`)."
        )
    if isinstance(exc, RenderBudgetExceeded):
        return ConfigError(
            f"The chat template ({source}) is refused: {exc}, so it would hang or exhaust memory (a loop over a "
            "huge range, a macro that recurses without end, or output without bound). Fix the template, or choose "
            "another `chat_template` (`tokenizer_default`, `chatml`)."
        )
    if isinstance(exc, RecursionError):
        return RowError(
            f"the chat template ({source}) recursed too deeply on this conversation (a macro that calls itself "
            "without end, or data nested too deeply)"
        )
    return RowError(f"the chat template failed on this conversation: {exc}")


def tokenizer_renderer(
    tokenizer: Any, template: str | None, source: str = "`chat_template`", tools: list[dict[str, Any]] | None = None
) -> Render:
    """Render a conversation with `template` through the tokenizer, within the render budget; `source` names the
    template in errors, `tools` is the row's tool list."""
    extra = {"tools": tools} if tools else {}

    def render(messages: list[dict[str, Any]]) -> str:
        try:
            return budgeted(
                template,
                lambda: tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **extra),
            )
        except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for bad conversations
            raise template_failure(exc, source) from None

    return render


def budgeted(template: str | None, render: Callable[[], str]) -> str:
    """`render()` within the render budget (see `render_budget`); a template of None is the owner's own."""
    return render() if template is None else render_within_budget(template, render)


_START, _END = itemgetter(0), itemgetter(1)  # a token's (start, end) character offsets


def conversation_labels(
    text: str,
    located: Located,
    messages: list[dict[str, Any]],
    ids: list[int],
    offsets: Sequence[tuple[int, int]],
    special: frozenset[int],
    ctx: FormatContext,
    image_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Labels for the tokens of a rendered conversation: the trained roles' text (a message's reasoning, the
    template's markup between it and the answer, and the answer), plus each turn's end-of-turn token as
    `train_on_eos` says; everything else is IGNORE_INDEX. `image_ids` are image placeholders, which may sit
    between a message's last text and its end-of-turn token.

    The end-of-turn token is the first special token after a message's text, or with `eot_tokens` the first of
    those or the EOS token (other special tokens before it are passed over)."""
    trained = [is_trained(m, ctx) for m in messages]
    for seg, span in located:
        # A template may leave out reasoning (of earlier turns) by design; `render_with_spans` checks the rest.
        if span is None and trained[seg.message] and seg.text and not seg.reasoning:
            i = seg.message
            raise RowError(f"the chat template leaves out message {i} ({messages[i]['role']}), which is to be trained")
    pieces: dict[int, list[tuple[tuple[int, int], Segment]]] = {}  # message -> its rendered segments, in text order
    for seg, span in sorted(((s, p) for s, p in located if p is not None), key=lambda item: item[1]):
        pieces.setdefault(seg.message, []).append((span, seg))
    last_trained = max((i for i in pieces if trained[i]), default=-1)
    labels = [IGNORE_INDEX] * len(ids)
    markers = (ctx.eot_ids | {ctx.tokenizer.eos_token_id}) if ctx.eot_ids else special
    for i, rendered in pieces.items():
        token = 0
        for n, ((start, end), seg) in enumerate(rendered):
            if seg.reasoning and n + 1 < len(rendered):
                end = rendered[n + 1][0][0]  # on to the answer: the markup that closes the reasoning is trained too
            # Tokens that overlap the text are trained (" The" may start on the space before the content): from
            # the first that ends after its start to the last that starts before its end (offsets run in order).
            # The offsets are searched in place (by key) rather than split into lists of starts and ends first:
            # a row has thousands of tokens and only a few spans.
            token = bisect.bisect_right(offsets, start, key=_END)
            if start >= end:
                continue
            past = bisect.bisect_left(offsets, end, lo=token, key=_START)
            if trained[i]:
                span = ids[token:past]
                labels[token:past] = [IGNORE_INDEX if t in image_ids else t for t in span] if image_ids else span
            token = past
        # The end-of-turn marker: a special token right after the message's last text, with only whitespace or
        # the message's trailing images between (with `eot_tokens`: other special tokens too).
        while token < len(ids) and (
            ids[token] in image_ids
            or (ctx.eot_ids and ids[token] in special and ids[token] not in markers)
            or (ids[token] not in special and not text[offsets[token][0] : offsets[token][1]].strip())
        ):
            token += 1
        if token < len(ids) and ids[token] in markers and _train_eos(ctx.train_on_eos, trained[i], i == last_trained):
            labels[token] = ids[token]
    return labels


def tokenize_row(row: dict[str, Any], ctx: FormatContext) -> dict[str, list[int]]:
    tok = ctx.tokenizer
    messages = read_messages(row, ctx)
    tools = read_tools(row, ctx.tools_field)
    render = tokenizer_renderer(tok, ctx.chat_template, ctx.template_source, tools)
    if ctx.train_on_inputs:
        refuse_weights_with_train_on_inputs(messages)
        ids = tok(render(messages), add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "labels": list(ids)}
    # What a rendering depends on besides the conversation: the template (the tokenizer's own when None) and the
    # special tokens that `apply_chat_template` hands it, and the row's tools.
    scope = (ctx.chat_template, tok.chat_template, tok.special_tokens_map, tools)
    text, located = render_with_spans(render, messages, ctx.thinking_key, remembered(render, scope))
    ids, encoding = encode_plain(tok, text)
    labels = conversation_labels(
        text, located, messages, ids, token_offsets(tok, text, encoding), special_ids_of(ctx), ctx
    )
    return {"input_ids": ids, "labels": labels}


def encode_plain(tok: Any, text: str) -> tuple[list[int], Any]:
    """`text`'s token ids with no special tokens added, and its Rust encoding (None for a tokenizer without one).

    The Rust tokenizer is called directly where it is set up as transformers would set it for this call: going
    through `tok(text)` adds about 80 µs of argument handling per row, 7% of tokenizing a chat."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and _set_up_as_called(tok, backend):
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding
    enc = tok(text, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
    return enc["input_ids"], (enc.encodings[0] if enc.encodings else None)


def _set_up_as_called(tok: Any, backend: Any) -> bool:
    """Whether the Rust tokenizer encodes as `tok(text)` would: transformers turns truncation and padding off for
    such a call, and encodes special tokens written in the text as special unless `split_special_tokens`."""
    split = bool(getattr(tok, "split_special_tokens", False))
    return backend.truncation is None and backend.padding is None and backend.encode_special_tokens == split


class EncodingOffsets(Sequence[tuple[int, int]]):
    """A fast tokenizer's token offsets, read token by token from its encoding (by non-negative index): labelling
    looks up a few tokens of a row, and turning all of its offsets into Python tuples costs more than that."""

    __slots__ = ("_encoding", "_length")

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding
        self._length = len(encoding)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, token: Any) -> Any:
        # `token_to_chars` reads the encoding's offsets; it gives None only for a token outside every sequence (one a
        # post-processor adds; none is added here), or past the end, where the list raises IndexError.
        found = self._encoding.token_to_chars(token)
        return found if found is not None else self._encoding.offsets[token]


def token_offsets(tok: Any, text: str, encoding: Any) -> Sequence[tuple[int, int]]:
    """The (start, end) character offsets of the tokens of `text` encoded by `tok` (`encoding`: its Rust encoding,
    None for a tokenizer without one)."""
    if encoding is not None:
        return EncodingOffsets(encoding)
    # A tokenizer without a Rust backend: asked for offsets directly (transformers refuses if it has none).
    return tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def refuse_weights_with_train_on_inputs(messages: list[dict[str, Any]]) -> None:
    """`train_on_inputs` trains every token, template markup included, so a turn marked `weight: 0` cannot be left
    out of it."""
    skipped = [i for i, m in enumerate(messages) if getattr(m, "train", None) is False]
    if skipped:
        raise RowError(
            f"message {skipped[0]} has `{WEIGHT_KEY}: 0`, but `train_on_inputs: true` trains every token of the "
            "conversation; set `train_on_inputs: false` and name the trained roles in `roles_to_train` (a message's "
            f"`{WEIGHT_KEY}` then overrides its role)"
        )


def _train_eos(mode: str, turn_trained: bool, is_last_trained: bool) -> bool:
    if mode == "all":
        return True
    if mode == "turn":
        return turn_trained
    if mode == "last":
        return is_last_trained
    return False
