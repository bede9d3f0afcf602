"""Microsoft's Phi-3, Phi-3.5 and Phi-4 chat formats."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate

_PHI3_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

# Phi-3 (Phi-3-mini/medium-*-instruct, first release): BOS; `<|system|>\n...<|end|>\n`; each user turn
# `<|user|>\n...<|end|>\n` is followed by `<|assistant|>\n`, so the answer is just content + `<|end|>\n`
# (a conversation ending with a user message is thus already a generation prompt).
PHI3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|user|>\n' + message['content'] + '<|end|>\n<|assistant|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + '<|end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Phi-3.5 (Phi-3.5-mini-instruct): `<|role|>\ncontent<|end|>\n` per message (an empty system message is left out),
# EOS after the last turn unless a generation prompt `<|assistant|>\n` is asked for.
PHI35_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and message['content'] %}"
    "{{- '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- elif message['role'] in ('user', 'assistant') %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)

# Phi-4 (microsoft/phi-4): `<|im_start|>role<|im_sep|>content<|im_end|>` per message, no newlines.
PHI4_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] in ('system', 'user', 'assistant') %}"
    "{{- '<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant<|im_sep|>' }}{%- endif %}"
)

TEMPLATES = {
    "phi_3": NamedTemplate(PHI3_TEMPLATE, _PHI3_MARKERS),
    "phi_35": NamedTemplate(PHI35_TEMPLATE, _PHI3_MARKERS),
    "phi_4": NamedTemplate(PHI4_TEMPLATE, ("<|im_start|>", "<|im_sep|>", "<|im_end|>")),
}
