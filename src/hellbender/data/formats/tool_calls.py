"""Tool use in chat rows: an assistant message's `tool_calls`, and the row's tool list (`field_tools`, default `tools`),
both handed to the chat template, which renders them in the model's own format.

Rows loaded through Arrow give every object of a column the union of the keys seen in that column, the absent ones
as null: a call's `arguments` would gain the other calls' parameters as `null`. Null values in objects are therefore
dropped; arguments or parameters written as a JSON string are parsed and kept exactly (nulls included).
"""

from __future__ import annotations

import json
from typing import Any

from hellbender.data.formats.base import RowError


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _json_object(value: Any, what: str) -> Any:
    """`value`, parsed when it is a JSON string; `what` names it in errors."""
    if not isinstance(value, str):
        return _without_nulls(value)
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(f"{what} is a string that is not valid JSON ({exc.msg} at character {exc.pos})") from None


def read_tool_calls(calls: Any, i: int, role: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, as OpenAI's format writes them (`{type: function, function: {name,
    arguments}}`, or the `{name, arguments}` inside it); `arguments` given as a JSON string are parsed."""
    if role != "assistant":
        raise RowError(f"message {i} ({role}) has `tool_calls`; only assistant messages call tools")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RowError(f"message {i} has `tool_calls` that are not a list of objects ({type(calls).__name__})")
    out = []
    for n, call in enumerate(calls):
        call = {k: v for k, v in call.items() if v is not None}
        function = call.get("function", call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RowError(
                f"message {i} tool call {n} has no function name; write each call as "
                "`{type: function, function: {name: ..., arguments: {...}}}`"
            )
        function = {k: v for k, v in function.items() if v is not None}
        if "arguments" in function:
            function["arguments"] = _json_object(function["arguments"], f"message {i} tool call {n}'s `arguments`")
        out.append({**call, "function": function} if "function" in call else function)
    return out


def read_tools(row: dict[str, Any], field: str | None) -> list[dict[str, Any]] | None:
    """The row's tool list (`field` names its column; None or a missing column: no tools), each tool a JSON schema
    object or a JSON string of one; a `function.parameters` string is parsed."""
    if not field or row.get(field) is None:
        return None
    tools = _json_object(row[field], f"column `{field}` (the tools, `field_tools`)")
    if not isinstance(tools, list) or not all(isinstance(t, dict | str) for t in tools):
        raise RowError(f"column `{field}` (the tools, `field_tools`) must be a list of tool schemas (JSON objects)")
    out = []
    for n, tool in enumerate(tools):
        tool = _json_object(tool, f"tool {n} of column `{field}`")
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and "parameters" in function:
            function["parameters"] = _json_object(function["parameters"], f"tool {n}'s `function.parameters`")
        out.append(tool)
    return out or None
