"""Meta's Llama 3 and Llama 4 chat formats (header tokens around the role, one end-of-turn token)."""

from __future__ import annotations

from hellbender.chat_templates.base import NamedTemplate, text_of, write_content

# Llama 3 (Meta-Llama-3-*-Instruct): BOS, then `<|start_header_id|>role<|end_header_id|>\n\n` + content + `<|eot_id|>`
# per message. The format trims each message's content.
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first %}{{- bos_token }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# Llama 4 (Llama-4-*-Instruct): BOS, then `<|header_start|>role<|header_end|>\n\n` + content + `<|eot|>`; only a
# leading system message is trimmed (its text parts joined), an image part is `<|image|>`, and tool results are
# `ipython` turns holding the result as a JSON string (quoted and escaped), as Llama 4's own template writes them.
LLAMA4_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] == 'system' %}"
    "{{- '<|header_start|>system<|header_end|>\n\n' + " + text_of("message['content']") + " | trim + '<|eot|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|header_start|>ipython<|header_end|>\n\n' + message['content'] | tojson + '<|eot|>' }}"
    "{%- else %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\n\n' }}"
    + write_content("<|image|>")
    + "{{- '<|eot|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\n\n' }}{%- endif %}"
)

TEMPLATES = {
    "llama3": NamedTemplate(LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "llama4": NamedTemplate(LLAMA4_TEMPLATE, ("<|header_start|>", "<|header_end|>", "<|eot|>"), images=True),
}
