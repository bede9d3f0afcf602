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

# Llama 3.2 Vision (Llama-3.2-*-Vision-Instruct): BOS; a text-only conversation opens with a system turn holding
# `Cutting Knowledge Date: December 2023\nToday Date: <date>\n\n` and the (trimmed) system text, a conversation
# with images has no system turn and may not have a system message; then Llama 3 turns with contents as is and
# `<|image|>` for an image part, tool results as `ipython` turns holding a JSON string. The date is
# `date_string` when the renderer passes one, else 26 Jul 2024 (the hub template's own fallback): the hub
# template writes today's date, which would change the training text from day to day.
LLAMA3_2_VISION_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = " + text_of("messages[0]['content']") + " | trim %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- set ns = namespace(images=false) %}"
    "{%- for message in turns %}{%- if message['content'] is not string %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{%- set ns.images = true %}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endfor %}"
    "{%- if ns.images and system %}"
    "{{- raise_exception('Llama 3.2 Vision takes no system message in a conversation with images') }}"
    "{%- elif not ns.images %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: '"
    " + date_string + '\n\n' + system + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] | tojson + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    + write_content("<|image|>")
    + "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

_LLAMA3_MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
TEMPLATES = {
    "llama3": NamedTemplate(LLAMA3_TEMPLATE, _LLAMA3_MARKERS),
    "llama3_2_vision": NamedTemplate(LLAMA3_2_VISION_TEMPLATE, _LLAMA3_MARKERS, images=True),
    "llama4": NamedTemplate(LLAMA4_TEMPLATE, ("<|header_start|>", "<|header_end|>", "<|eot|>"), images=True),
}
