"""Preference rows (`type: chatml.intel`, `chat_template.default`, ...) read into the texts that are tokenized.

Every type gives a prompt text and, per answer (`chosen` and `rejected`, or KTO's one `completion`), the full text of
prompt plus answer. Two kinds of type:

- fixed-format types (`chatml.*`, `llama3.*`, `zephyr.nectar`, `user_defined.default`) write the turns with their
  family's markup, as Axolotl's transforms do, and end each answer with the tokenizer's EOS unless it already ends
  with it (TRL does this for text rows); the tokenizer adds its own BOS, if it has one, as TRL tokenizes text rows;
- chat-template types (`chat_template.*`, `bradley_terry.chat_template`) render the prompt messages with a
  generation prompt, and the prompt messages followed by the answer without one, through the dataset's chat
  template; the template writes every special token (BOS included) and the end-of-turn after the answer.

`preference.tokenize_preference_row` then checks that each full text continues the prompt exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hellbender.data.formats.base import FormatContext, RowError, text_value
from hellbender.data.formats.chat_template import budgeted, read_messages, template_failure

# (turn opening with `{role}`, turn end, answer opening): the markup of Axolotl's fixed-format families.
FAMILY_MARKUP = {
    "chatml": ("<|im_start|>{role}\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama3": (
        "<|start_header_id|>{role}<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}
# The special tokens of each family's markup, which the tokenizer must have as single tokens.
FAMILY_MARKERS = {"chatml": ("<|im_start|>", "<|im_end|>"), "llama3": ("<|start_header_id|>", "<|end_header_id|>",
                                                                       "<|eot_id|>")}  # fmt: skip
# The end of an answer in each family (the turn end without the newline that would start the next turn).
FAMILY_ANSWER_END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
# Axolotl's zephyr.nectar prompt: an empty system turn, the user's prompt, the assistant's opening.
ZEPHYR_PROMPT = "<|system|>\n</s>\n<|user|>\n{prompt}</s>\n<|assistant|>\n"
# The column each fixed-format type reads the prompt from (paired rows; KTO rows read the same).
PROMPT_COLUMN = {"icr": "input", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt", "argilla": None}
# `<family>.default` (and paired `argilla`) take the first of these columns the row has, as Axolotl's default does.
DEFAULT_PROMPT_COLUMNS = ("prompt", "input", "question", "instruction")


@dataclass(frozen=True)
class PreferenceContext:
    """A preference dataset entry's settings as its rows are read: `kind` is the entry's `type`, `kto` whether rows
    are KTO's unpaired ones (`rl: kto`), `messages` the message-reading settings (role and content keys, role names)
    of chat-template types, `template` their chat template; `fields` the entry's columns and `*_format` strings
    (`USER_DEFINED_KEYS` names, defaults filled)."""

    tokenizer: Any
    kind: str
    kto: bool
    fields: dict[str, str]
    messages: FormatContext
    template: str | None = None
    template_source: str = "`chat_template`"
    # Vision-language rows (`data/preference_images.py`): prompt messages may hold image parts.
    allow_parts: bool = False


@dataclass(frozen=True)
class PreferenceText:
    """A row's texts: the prompt, and per answer name (`chosen`, `rejected` or `completion`) the full text of prompt
    and answer; `label` is a KTO row's label. `special_tokens`: whether the tokenizer adds its own (BOS)."""

    prompt: str
    full: dict[str, str]
    label: bool | None
    special_tokens: bool


def answer_names(kto: bool) -> tuple[str, ...]:
    return ("completion",) if kto else ("chosen", "rejected")


def read_preference_row(row: dict[str, Any], ctx: PreferenceContext) -> PreferenceText:
    family, _, variant = ctx.kind.partition(".")
    variant = variant or "default"
    if family in FAMILY_MARKUP:
        return _family_row(row, ctx, family, variant)
    if family == "zephyr":
        return _nectar_row(row, ctx)
    if family == "user_defined":
        return _user_defined_row(row, ctx)
    return _template_row(row, ctx)


# ----------------------------------------------------------------------------------------------- reading columns


def _messages(value: Any, column: str, ctx: FormatContext, allow_parts: bool = False) -> list[dict[str, Any]]:
    """`value` (a message list of column `column`) as template messages, with errors naming the column; with
    `allow_parts`, contents may be lists of text and image parts (vision-language rows)."""
    try:
        return list(read_messages({column: value}, replace(ctx, field_messages=column), allow_parts=allow_parts))
    except RowError as exc:
        raise RowError(f"column `{column}`: {exc}") from None


def _message(value: Any, column: str, ctx: FormatContext, allow_parts: bool = False) -> dict[str, Any]:
    """One answer: a string (an assistant message), a message, or a message list whose last message is the answer."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        return _messages([value], column, ctx, allow_parts)[0]
    if isinstance(value, list) and value:
        return _messages(value, column, ctx, allow_parts)[-1]
    raise RowError(
        f"column `{column}` must hold the answer: a text, a message, or a list of messages ending with the answer "
        f"(it holds {_what(value)})"
    )


def _what(value: Any) -> str:
    return "an empty list" if value == [] else "null" if value is None else f"a {type(value).__name__}"


def _column(row: dict[str, Any], column: str) -> Any:
    # Rows of a JSON file that lack a key other rows have hold null there.
    if row.get(column) is None:
        raise RowError(f"column `{column}` is missing or null (columns: {', '.join(sorted(row))})")
    return row[column]


def _answer_value(row: dict[str, Any], column: str, name: str) -> Any:
    if row.get(column) is None:
        raise RowError(
            f"the row has no {name} answer: column `{column}` is missing or null (columns: {', '.join(sorted(row))})"
        )
    return row[column]


def _answer_text(row: dict[str, Any], column: str, name: str) -> str:
    _answer_value(row, column, name)
    text = text_value(row, column)
    if not text.strip():
        raise RowError(f"the {name} answer (column `{column}`) is empty; every answer must say something")
    return text


def _checked_answer(message: dict[str, Any], column: str, name: str) -> dict[str, Any]:
    if message["role"] != "assistant":
        raise RowError(
            f"the {name} answer (column `{column}`) is a `{message['role']}` message; an answer is the assistant's "
            "(map the dataset's role name onto `assistant` with `roles:`)"
        )
    content = message["content"]
    if isinstance(content, list):  # content parts (vision-language rows): an answer is text only
        if any(part["type"] != "text" for part in content):
            raise RowError(
                f"the {name} answer (column `{column}`) holds an image; images belong in the prompt, and an answer "
                "is the model's text"
            )
        content = "".join(part["text"] for part in content)
        message = {**message, "content": content}
    if not isinstance(content, str) or not content.strip():
        raise RowError(f"the {name} answer (column `{column}`) is empty; every answer must say something")
    return message


def _conversation_pair(
    row: dict[str, Any], ctx: FormatContext, chosen_col: str, rejected_col: str, allow_parts: bool = False
):
    """(prompt messages, chosen answer, rejected answer) of rows whose `chosen` and `rejected` hold whole
    conversations: the answers are their last messages, and the messages before must be the same prompt."""
    lists = {}
    for column, name in ((chosen_col, "chosen"), (rejected_col, "rejected")):
        value = _answer_value(row, column, name)
        if not isinstance(value, list) or len(value) < 2:
            raise RowError(
                f"column `{column}` must hold the conversation: the prompt's messages, then the answer (it holds "
                f"{_what(value) if not isinstance(value, list) else f'{len(value)} message(s)'})"
            )
        lists[column] = _messages(value, column, ctx, allow_parts)
    chosen, rejected = lists[chosen_col], lists[rejected_col]
    if [dict(m) for m in chosen[:-1]] != [dict(m) for m in rejected[:-1]]:
        first = next(
            (i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1], strict=False)) if dict(a) != dict(b)),
            min(len(chosen), len(rejected)) - 1,
        )
        raise RowError(
            f"the chosen and rejected conversations (columns `{chosen_col}` and `{rejected_col}`) differ before their "
            f"answers (at message {first}): a preference pair answers one prompt, so every message but the last "
            "must be the same in both"
        )
    return (
        chosen[:-1],
        _checked_answer(chosen[-1], chosen_col, "chosen"),
        _checked_answer(rejected[-1], rejected_col, "rejected"),
    )


def _label(row: dict[str, Any], column: str) -> bool:
    if column not in row or row[column] is None:
        raise RowError(
            f"column `{column}` with the KTO label is missing (columns: {', '.join(sorted(row))}); each KTO row says "
            "whether its answer is desirable (`true`) or not (`false`)"
        )
    value = row[column]
    if not isinstance(value, bool):
        raise RowError(
            f"the KTO label (column `{column}`) is {value!r}; it must be `true` (a desirable answer) or `false`"
        )
    return value


# ------------------------------------------------------------------------------------------- fixed-format types


def _with_eos(text: str, tokenizer: Any) -> str:
    eos = tokenizer.eos_token
    return text if not eos or text.endswith(eos) else text + eos


def _texts(prompt: str, answers: dict[str, str], ctx: PreferenceContext, label: bool | None) -> PreferenceText:
    full = {name: prompt + _with_eos(answer, ctx.tokenizer) for name, answer in answers.items()}
    return PreferenceText(prompt=prompt, full=full, label=label, special_tokens=True)


def _family_turns(family: str, messages: list[dict[str, Any]]) -> str:
    opening, end, answer = FAMILY_MARKUP[family]
    return "".join(opening.replace("{role}", m["role"]) + m["content"] + end for m in messages) + answer


def _system_and_user(row: dict[str, Any], column: str) -> list[dict[str, Any]]:
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowError(f"column `system` must hold text, not {type(system).__name__}")
    user = text_value(row, column) if column in row else _column(row, column)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _family_row(row: dict[str, Any], ctx: PreferenceContext, family: str, variant: str) -> PreferenceText:
    end = FAMILY_ANSWER_END[family]
    if ctx.kto:
        label = _label(row, "label")
        if variant == "argilla_chat":
            value = _column(row, "completion")
            if not isinstance(value, list) or len(value) < 2:
                raise RowError("column `completion` must hold the conversation: the prompt's messages, then the answer")
            messages = _messages(value, "completion", ctx.messages)
            answer = _checked_answer(messages[-1], "completion", "KTO")["content"]
            return _texts(_family_turns(family, messages[:-1]), {"completion": answer + end}, ctx, label)
        column = "instruction" if variant == "argilla" else PROMPT_COLUMN[variant]
        prompt = _family_turns(family, _system_and_user(row, column))
        return _texts(prompt, {"completion": _answer_text(row, "completion", "KTO") + end}, ctx, label)
    if variant == "argilla_chat":
        messages, chosen, rejected = _conversation_pair(row, ctx.messages, "chosen", "rejected")
        answers = {"chosen": chosen["content"] + end, "rejected": rejected["content"] + end}
        return _texts(_family_turns(family, messages), answers, ctx, None)
    if variant in ("default", "argilla"):
        column = next((c for c in DEFAULT_PROMPT_COLUMNS if c in row), "instruction")
        chosen_col = "chosen" if "chosen" in row else "chosen_response"
        rejected_col = "rejected" if "rejected" in row else "rejected_response"
    else:
        column, chosen_col, rejected_col = PROMPT_COLUMN[variant], "chosen", "rejected"
    prompt = _family_turns(family, _system_and_user(row, column))
    if variant == "ultra":  # ultrafeedback: the answers are conversations ending with the assistant's answer
        answers = {
            name: _checked_answer(_message(_answer_value(row, name, name), name, ctx.messages), name, name)["content"]
            + end
            for name in ("chosen", "rejected")
        }
    else:
        answers = {
            "chosen": _answer_text(row, chosen_col, "chosen") + end,
            "rejected": _answer_text(row, rejected_col, "rejected") + end,
        }
    return _texts(prompt, answers, ctx, None)


def _nectar_row(row: dict[str, Any], ctx: PreferenceContext) -> PreferenceText:
    prompt = ZEPHYR_PROMPT.replace("{prompt}", text_value(row, "prompt") if "prompt" in row else _column(row, "prompt"))
    answers = _column(row, "answers")
    if not isinstance(answers, list) or len(answers) < 2:
        raise RowError("column `answers` must hold at least two ranked answers (`{answer: ..., rank: ...}`)")
    for i, item in enumerate(answers):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("answer"), str)
            or isinstance(item.get("rank"), bool)
            or not isinstance(item.get("rank"), int | float)
        ):
            raise RowError(f"answer {i} of column `answers` needs a text `answer` and a number `rank`")
    # Rank 1 is the best answer (Nectar's ranking): the best is chosen, the second best rejected.
    ranked = sorted(answers, key=lambda item: item["rank"])
    texts = {"chosen": ranked[0]["answer"], "rejected": ranked[1]["answer"]}
    for name, text in texts.items():
        if not text.strip():
            raise RowError(f"the {name} answer (column `answers`) is empty; every answer must say something")
    return _texts(prompt, texts, ctx, None)


def _formatted(template: str, **values: str) -> str:
    """A `*_format` string filled in; config validation allowed only these names in it."""
    return template.format(**values)


def _user_defined_row(row: dict[str, Any], ctx: PreferenceContext) -> PreferenceText:
    f = ctx.fields
    system_col = f["field_system"]
    system = row.get(system_col)
    if system is not None and not isinstance(system, str):
        raise RowError(f"column `{system_col}` must hold text, not {type(system).__name__}")
    prompt = _formatted(f["prompt_format"], prompt=text_value(row, f["field_prompt"]), system=system or "")
    if ctx.kto:
        label = _label(row, f["field_label"])
        answer = _answer_text(row, f["field_completion"], "KTO")
        return _texts(prompt, {"completion": _formatted(f["completion_format"], completion=answer)}, ctx, label)
    answers = {
        name: _formatted(f[f"{name}_format"], **{name: _answer_text(row, f[f"field_{name}"], name)})
        for name in ("chosen", "rejected")
    }
    return _texts(prompt, answers, ctx, None)


# ------------------------------------------------------------------------------------------- chat-template types


def _render(ctx: PreferenceContext, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        return budgeted(
            ctx.template,
            lambda: ctx.tokenizer.apply_chat_template(
                plain, chat_template=ctx.template, tokenize=False, add_generation_prompt=generation_prompt
            ),
        )
    except Exception as exc:  # jinja raises many kinds (TemplateError, TypeError, ...) for bad conversations
        raise template_failure(exc, ctx.template_source) from None


def template_messages(row: dict[str, Any], ctx: PreferenceContext):
    """(prompt messages, chosen answer message, rejected answer message) of a chat-template type's row."""
    chosen_col, rejected_col = ctx.fields["field_chosen"], ctx.fields["field_rejected"]
    parts = ctx.allow_parts
    if ctx.kind == "bradley_terry.chat_template":
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise RowError(f"column `system` must hold text, not {type(system).__name__}")
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text_value(row, "input") if "input" in row else _column(row, "input")}
        ]
        chosen = {"role": "assistant", "content": _answer_text(row, chosen_col, "chosen")}
        rejected = {"role": "assistant", "content": _answer_text(row, rejected_col, "rejected")}
    elif ctx.kind == "chat_template.default":
        column = ctx.messages.field_messages or "messages"
        value = _column(row, column)
        if isinstance(value, str):
            prompt = [{"role": "user", "content": value}]
        else:
            prompt = _messages(value, column, ctx.messages, parts)
        answers = {}
        for name, col in (("chosen", chosen_col), ("rejected", rejected_col)):
            message = _message(_answer_value(row, col, name), col, ctx.messages, parts)
            answers[name] = _checked_answer(message, col, name)
        chosen, rejected = answers["chosen"], answers["rejected"]
        both = [row[chosen_col], row[rejected_col]]
        if all(isinstance(v, list) and len(v) > 1 for v in both):  # whole conversations: their prompts must agree
            _conversation_pair(row, ctx.messages, chosen_col, rejected_col, parts)
    else:  # chat_template.argilla_chat, and ORPO's chat_template.argilla (an optional `system` and `prompt`)
        prompt, chosen, rejected = _conversation_pair(row, ctx.messages, chosen_col, rejected_col, parts)
        if ctx.kind == "chat_template.argilla":
            if isinstance(row.get("prompt"), str) and row["prompt"]:
                prompt = [{"role": "user", "content": row["prompt"]}]
            system = row.get("system")
            if isinstance(system, str) and system and not any(m["role"] == "system" for m in prompt):
                prompt = [{"role": "system", "content": system}, *prompt]
    if not prompt:
        raise RowError("the prompt has no messages; a preference pair answers a prompt")
    return prompt, chosen, rejected


def _template_row(row: dict[str, Any], ctx: PreferenceContext) -> PreferenceText:
    prompt, chosen, rejected = template_messages(row, ctx)
    text = _render(ctx, prompt, generation_prompt=True)
    # The template's text after the answer's end-of-turn (a newline before the next turn) is not part of the answer.
    full = {
        name: _render(ctx, [*prompt, answer], False).rstrip()
        for name, answer in (("chosen", chosen), ("rejected", rejected))
    }
    return PreferenceText(prompt=text, full=full, label=None, special_tokens=False)
