"""LG AI Research's EXAONE chat formats (`[|role|]` tokens, `[|endofturn|]` closing turns)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

# EXAONE 3.0 / 3.5 Instruct: a conversation without a leading system message opens with an empty system turn
# `[|system|][|endofturn|]\n`; a user turn is `[|user|]content\n`, any other turn `[|role|]content[|endofturn|]\n`.
EXAONE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '[|system|][|endofturn|]\n' }}{%- endif %}"
    "{{- '[|' + message['role'] + '|]' + message['content'] }}"
    "{%- if message['role'] == 'user' %}{{- '\n' }}{%- else %}{{- '[|endofturn|]\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[|assistant|]' }}{%- endif %}"
)

# EXAONE 4.0: every turn `[|role|]\ncontent[|endofturn|]\n`, contents as is (no default system turn). An assistant
# turn opens with an empty think block `<think>\n\n</think>\n\n`, and a `<think>...</think>` written in its content
# is dropped (the rest trimmed); with `skip_think=false` the last message keeps it in the block instead (EXAONE's
# own template cuts two characters too many after `<think>` there, which would eat the reasoning's first
# character; here only the tag goes). Consecutive tool results share one `[|tool|]` turn, each written
# `<tool_result>{"result": <content as a JSON string>}</tool_result>`, one per line. The generation prompt holds the
# empty think block, or with `enable_thinking=true` opens one.
EXAONE4_TEMPLATE = (
    "{%- set skip = skip_think if skip_think is defined else true %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '[|assistant|]\n' }}"
    "{%- if message['content'] %}{%- set content = message['content'] %}{%- set reasoning = none %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0] | trim %}"
    "{%- if reasoning.startswith('<think>') %}{%- set reasoning = reasoning[7:] | trim %}{%- endif %}"
    "{%- set content = content.split('</think>')[-1] | trim %}{%- endif %}"
    "{%- if not skip and loop.last and reasoning is not none %}{{- '<think>\n' + reasoning + '\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{{- content }}{%- endif %}"
    "{{- '[|endofturn|]\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '[|tool|]\n' }}{%- endif %}"
    "{{- '<tool_result>{\"result\": ' + message['content'] | tojson + '}</tool_result>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '[|endofturn|]\n' }}"
    "{%- else %}{{- '\n' }}{%- endif %}"
    "{%- else %}{{- '[|' + message['role'] + '|]\n' + message['content'] + '[|endofturn|]\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[|assistant|]\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>\n' }}"
    "{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

_MARKERS = ("[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]")
TEMPLATES = {
    "exaone": NamedTemplate(EXAONE_TEMPLATE, _MARKERS),
    "exaone4": NamedTemplate(EXAONE4_TEMPLATE, (*_MARKERS, "<think>", "</think>")),
}
