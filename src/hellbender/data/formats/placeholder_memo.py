"""Placeholder renderings remembered across rows, so that preparing a dataset renders each conversation once.

Finding where each message's text lands (`chat_template.render_with_spans`) renders the conversation a second time
with every text replaced by a numbered placeholder. That placeholder conversation holds the row's shape only (its
roles, keys, the number of texts per message, its tool calls), so the many rows of a dataset that share a shape render
the identical placeholder conversation, and rendering it again would give the same text. The memo keys a rendering by
everything it depends on: the conversation and a `scope` naming the rest (the template, the tokenizer's special
tokens, the row's tools). Only plain data (text, numbers, booleans, None, lists, tuples and dicts of them) is
remembered: their `repr` tells any two different values apart, which a key built from another object's `repr` could
not promise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Render = Callable[[list[dict[str, Any]]], str]

MEMO_SIZE = 4096  # renderings kept per process; a dataset has a few shapes, so forgetting all at once is cheap
_SCALARS = (str, int, float, bool, type(None))
_RENDERED: dict[tuple[str, str], str] = {}


def is_plain(value: Any) -> bool:
    """Whether `value` is made of plain data only (exact types, no subclasses, whose `repr` could hide a difference)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        return all(type(key) is str and is_plain(item) for key, item in value.items())
    if kind is list or kind is tuple:
        return all(is_plain(item) for item in value)
    return False


def remembered(render: Render, scope: Any) -> Render:
    """`render`, remembering its text for plain conversations rendered under the same `scope` (everything besides the
    conversation that the rendering depends on). A conversation or scope that is not plain data is rendered anew."""
    scope_key = repr(scope) if is_plain(scope) else None

    def render_remembered(messages: list[dict[str, Any]]) -> str:
        if scope_key is None or not is_plain(messages):
            return render(messages)
        key = (scope_key, repr(messages))
        text = _RENDERED.get(key)
        if text is None:
            text = render(messages)
            if len(_RENDERED) >= MEMO_SIZE:
                _RENDERED.clear()  # plain dict operations only: safe when rows are rendered on several threads
            _RENDERED[key] = text
        return text

    return render_remembered
