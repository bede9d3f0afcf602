"""Named chat templates (`chat_template: llama3`, ...): each renders its family's published format exactly.

The expected strings below are written by hand from each family's published chat format (the model cards and
hub tokenizer configs); they are the spec. Special tokens a template takes from the tokenizer (BOS, EOS) are
given the family's own spelling. A few templates are then run through hellbender's real preparation path to
check that the assistant turns, and only they, are trained.
"""

from __future__ import annotations

import pytest

from hellbender.chat_templates import FALLBACK_PREFIX, NAMED_TEMPLATES, TEMPLATE_NAMES, resolve_chat_template
from hellbender.config import validate_config
from hellbender.data.contexts import format_context
from hellbender.data.formats import FORMATTERS, RowError
from hellbender.errors import ConfigError
from hellbender.models.tiny import build_tiny_tokenizer

IGNORE = -100
SYSTEM, U1, A1, U2, A2 = "You are terse.", "What is two plus two?", "Four.", "And three plus three?", "Six, of course."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": U2},
    {"role": "assistant", "content": A2},
]
PROMPT = CONVERSATION[:4]  # ends with a user message: the generation prompt follows it

# name -> (bos_token, eos_token, rendering of CONVERSATION, rendering of PROMPT with add_generation_prompt)
EXPECTED: dict[str, tuple[str | None, str | None, str, str]] = {
    "chatml": (
        None,
        None,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\nSix, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "qwen_25": (
        None,
        "<|im_end|>",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\nSix, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # Qwen3: the last assistant turn (after the last user query) carries an empty think block.
    "qwen3": (
        None,
        "<|im_end|>",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nSix, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "llama3": (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd three plus three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nSix, of course.<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd three plus three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "llama4": (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nYou are terse.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nWhat is two plus two?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nFour.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nAnd three plus three?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nSix, of course.<|eot|>",
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nYou are terse.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nWhat is two plus two?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nFour.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nAnd three plus three?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n",
    ),
    # Gemma 3: the system text opens the first user turn, followed by a blank line; the assistant is `model`.
    "gemma3": (
        "<bos>",
        "<eos>",
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is two plus two?<end_of_turn>\n"
        "<start_of_turn>model\nFour.<end_of_turn>\n<start_of_turn>user\nAnd three plus three?<end_of_turn>\n"
        "<start_of_turn>model\nSix, of course.<end_of_turn>\n",
        "<bos><start_of_turn>user\nYou are terse.\n\nWhat is two plus two?<end_of_turn>\n"
        "<start_of_turn>model\nFour.<end_of_turn>\n<start_of_turn>user\nAnd three plus three?<end_of_turn>\n"
        "<start_of_turn>model\n",
    ),
    # Mistral v1: the system text joins the first user message.
    "mistral_v1": (
        "<s>",
        "</s>",
        "<s> [INST] You are terse.\n\nWhat is two plus two? [/INST] Four.</s>"
        " [INST] And three plus three? [/INST] Six, of course.</s>",
        "<s> [INST] You are terse.\n\nWhat is two plus two? [/INST] Four.</s> [INST] And three plus three? [/INST]",
    ),
    # Mistral v2/v3 and Tekken v3: the system text joins the last user message.
    "mistral_v2v3": (
        "<s>",
        "</s>",
        "<s>[INST] What is two plus two?[/INST] Four.</s>"
        "[INST] You are terse.\n\nAnd three plus three?[/INST] Six, of course.</s>",
        "<s>[INST] What is two plus two?[/INST] Four.</s>[INST] You are terse.\n\nAnd three plus three?[/INST]",
    ),
    "mistral_v3_tekken": (
        "<s>",
        "</s>",
        "<s>[INST]What is two plus two?[/INST]Four.</s>"
        "[INST]You are terse.\n\nAnd three plus three?[/INST]Six, of course.</s>",
        "<s>[INST]What is two plus two?[/INST]Four.</s>[INST]You are terse.\n\nAnd three plus three?[/INST]",
    ),
    "mistral_v7_tekken": (
        "<s>",
        "</s>",
        "<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][INST]What is two plus two?[/INST]Four.</s>"
        "[INST]And three plus three?[/INST]Six, of course.</s>",
        "<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][INST]What is two plus two?[/INST]Four.</s>"
        "[INST]And three plus three?[/INST]",
    ),
    # Phi-3: every user turn is followed by the assistant header, so the prompt needs nothing more.
    "phi_3": (
        "<s>",
        "<|endoftext|>",
        "<s><|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\nFour.<|end|>\n"
        "<|user|>\nAnd three plus three?<|end|>\n<|assistant|>\nSix, of course.<|end|>\n",
        "<s><|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\nFour.<|end|>\n"
        "<|user|>\nAnd three plus three?<|end|>\n<|assistant|>\n",
    ),
    # Phi-3.5: EOS closes a conversation that is not a generation prompt.
    "phi_35": (
        "<s>",
        "<|endoftext|>",
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\nFour.<|end|>\n"
        "<|user|>\nAnd three plus three?<|end|>\n<|assistant|>\nSix, of course.<|end|>\n<|endoftext|>",
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\nFour.<|end|>\n"
        "<|user|>\nAnd three plus three?<|end|>\n<|assistant|>\n",
    ),
    "phi_4": (
        "<|endoftext|>",
        "<|im_end|>",
        "<|im_start|>system<|im_sep|>You are terse.<|im_end|><|im_start|>user<|im_sep|>What is two plus two?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Four.<|im_end|><|im_start|>user<|im_sep|>And three plus three?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Six, of course.<|im_end|>",
        "<|im_start|>system<|im_sep|>You are terse.<|im_end|><|im_start|>user<|im_sep|>What is two plus two?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Four.<|im_end|><|im_start|>user<|im_sep|>And three plus three?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>",
    ),
    "deepseek_v2": (
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>You are terse.\n\n<｜User｜>What is two plus two?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
        "<｜User｜>And three plus three?<｜Assistant｜>Six, of course.<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>You are terse.\n\n<｜User｜>What is two plus two?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
        "<｜User｜>And three plus three?<｜Assistant｜>",
    ),
    # DeepSeek-V3: the system text comes first with no separator before the first user turn.
    "deepseek_v3": (
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is two plus two?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
        "<｜User｜>And three plus three?<｜Assistant｜>Six, of course.<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is two plus two?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
        "<｜User｜>And three plus three?<｜Assistant｜>",
    ),
    "cohere": (
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are terse.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is two plus two?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Four.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>And three plus three?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Six, of course.<|END_OF_TURN_TOKEN|>",
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are terse.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is two plus two?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Four.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>And three plus three?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    # Falcon-H1: BOS (spelled here as a placeholder), then ChatML.
    "falcon_h1": (
        "<BOS>",
        "<|end_of_text|>",
        "<BOS><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\nSix, of course.<|im_end|>\n",
        "<BOS><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # EXAONE: user turns end with a newline only, every other turn with `[|endofturn|]` and a newline.
    "exaone": (
        "[BOS]",
        "[|endofturn|]",
        "[|system|]You are terse.[|endofturn|]\n[|user|]What is two plus two?\n[|assistant|]Four.[|endofturn|]\n"
        "[|user|]And three plus three?\n[|assistant|]Six, of course.[|endofturn|]\n",
        "[|system|]You are terse.[|endofturn|]\n[|user|]What is two plus two?\n[|assistant|]Four.[|endofturn|]\n"
        "[|user|]And three plus three?\n[|assistant|]",
    ),
    "qwen2_vl": (
        None,
        "<|im_end|>",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\nSix, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    # Llama 3.2 Vision, text only: a system turn with the knowledge-cutoff and date lines before the system text.
    "llama3_2_vision": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd three plus three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nSix, of course.<|eot_id|>",
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd three plus three?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    # Pixtral: Tekken v3's turns; the system text joins the last user message.
    "pixtral": (
        "<s>",
        "</s>",
        "<s>[INST]What is two plus two?[/INST]Four.</s>"
        "[INST]You are terse.\n\nAnd three plus three?[/INST]Six, of course.</s>",
        "<s>[INST]What is two plus two?[/INST]Four.</s>[INST]You are terse.\n\nAnd three plus three?[/INST]",
    ),
    "granite": (
        None,
        "<|end_of_text|>",
        "<|start_of_role|>system<|end_of_role|>You are terse.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>What is two plus two?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Four.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>And three plus three?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Six, of course.<|end_of_text|>\n",
        "<|start_of_role|>system<|end_of_role|>You are terse.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>What is two plus two?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Four.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>And three plus three?<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
    # Qwen3.5: as Qwen3 for this conversation; the generation prompt opens a think block.
    "qwen3_5": (
        None,
        "<|im_end|>",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nSix, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n",
    ),
    # Gemma 4: `<|turn>role ... <turn|>`, the system message in its own turn; the generation prompt holds an empty
    # thought channel.
    "gemma4": (
        "<bos>",
        "<eos>",
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nWhat is two plus two?<turn|>\n"
        "<|turn>model\nFour.<turn|>\n<|turn>user\nAnd three plus three?<turn|>\n"
        "<|turn>model\nSix, of course.<turn|>\n",
        "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nWhat is two plus two?<turn|>\n"
        "<|turn>model\nFour.<turn|>\n<|turn>user\nAnd three plus three?<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>",
    ),
    # Jamba: a space after each role token; `<|eom|>` closes every message.
    "jamba": (
        "<|startoftext|>",
        "<|endoftext|>",
        "<|startoftext|><|bom|><|system|> You are terse.<|eom|><|bom|><|user|> What is two plus two?<|eom|>"
        "<|bom|><|assistant|> Four.<|eom|><|bom|><|user|> And three plus three?<|eom|>"
        "<|bom|><|assistant|> Six, of course.<|eom|>",
        "<|startoftext|><|bom|><|system|> You are terse.<|eom|><|bom|><|user|> What is two plus two?<|eom|>"
        "<|bom|><|assistant|> Four.<|eom|><|bom|><|user|> And three plus three?<|eom|><|bom|><|assistant|>",
    ),
    # EXAONE 4: a newline after each role token, `[|endofturn|]` after every turn, an empty think block in every
    # answer and in the generation prompt.
    "exaone4": (
        "[BOS]",
        "[|endofturn|]",
        "[|system|]\nYou are terse.[|endofturn|]\n[|user|]\nWhat is two plus two?[|endofturn|]\n"
        "[|assistant|]\n<think>\n\n</think>\n\nFour.[|endofturn|]\n[|user|]\nAnd three plus three?[|endofturn|]\n"
        "[|assistant|]\n<think>\n\n</think>\n\nSix, of course.[|endofturn|]\n",
        "[|system|]\nYou are terse.[|endofturn|]\n[|user|]\nWhat is two plus two?[|endofturn|]\n"
        "[|assistant|]\n<think>\n\n</think>\n\nFour.[|endofturn|]\n[|user|]\nAnd three plus three?[|endofturn|]\n"
        "[|assistant|]\n<think>\n\n</think>\n\n",
    ),
    # Nemotron 3: ChatML, every answer behind an empty `<think></think>`; the generation prompt opens a think block.
    "nemotron_h": (
        None,
        "<|im_end|>",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>Four.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>Six, of course.<|im_end|>\n",
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>Four.<|im_end|>\n<|im_start|>user\nAnd three plus three?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n",
    ),
}
# Formats another family publishes unchanged: Aya uses Command-R's, Gemma 3n writes text turns as Gemma 3, Gemma 4
# Unified uses Gemma 4's.
EXPECTED["aya"] = EXPECTED["cohere"]
EXPECTED["gemma3n"] = EXPECTED["gemma3"]
EXPECTED["gemma4_unified"] = EXPECTED["gemma4"]


def render(name: str, messages, bos: str | None, eos: str | None, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    rendered, _ = render_jinja_template([messages], chat_template=NAMED_TEMPLATES[name].jinja, **specials, **kwargs)
    return rendered[0]


def test_every_named_template_has_an_expected_rendering():
    # gemma has no system role, so its conversation is checked on its own below.
    assert set(NAMED_TEMPLATES) - {"gemma"} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_renders_the_conversation_in_the_family_format(name):
    bos, eos, conversation, _ = EXPECTED[name]
    assert render(name, CONVERSATION, bos, eos) == conversation


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_renders_the_generation_prompt_in_the_family_format(name):
    bos, eos, _, prompt = EXPECTED[name]
    assert render(name, PROMPT, bos, eos, add_generation_prompt=True) == prompt


def test_gemma_renders_user_and_model_turns_and_refuses_a_system_message():
    turns = CONVERSATION[1:]
    assert render("gemma", turns, "<bos>", "<eos>") == (
        "<bos><start_of_turn>user\nWhat is two plus two?<end_of_turn>\n<start_of_turn>model\nFour.<end_of_turn>\n"
        "<start_of_turn>user\nAnd three plus three?<end_of_turn>\n<start_of_turn>model\nSix, of course.<end_of_turn>\n"
    )
    assert render("gemma", turns[:3], "<bos>", "<eos>", add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nWhat is two plus two?<end_of_turn>\n<start_of_turn>model\nFour.<end_of_turn>\n"
        "<start_of_turn>user\nAnd three plus three?<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(Exception, match="no system role"):
        render("gemma", CONVERSATION, "<bos>", "<eos>")


def test_qwen_25_writes_its_default_system_turn_and_groups_tool_results():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "12C"},
        {"role": "assistant", "content": "Rain, 12C."},
    ]
    assert render("qwen_25", messages, None, None) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\nChecking.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n12C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nRain, 12C.<|im_end|>\n"
    )


def test_qwen3_moves_a_written_think_block_and_closes_it_when_thinking_is_off():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello"},
    ]
    assert render("qwen3", messages, None, None) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nsay hi\n</think>\n\nHello<|im_end|>\n"
    )
    assert render("qwen3", messages[:1], None, None, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


TOOL_EXCHANGE = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking."},
    {"role": "tool", "content": "rain"},
    {"role": "tool", "content": "12C"},
    {"role": "assistant", "content": "Rain, 12C."},
]


def test_qwen3_5_opens_a_think_block_in_every_answer_after_the_last_query_and_groups_tool_results():
    assert render("qwen3_5", TOOL_EXCHANGE, None, None) == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n12C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nRain, 12C.<|im_end|>\n"
    )
    answered = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello"},
    ]
    assert render("qwen3_5", answered, None, None) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nsay hi\n</think>\n\nHello<|im_end|>\n"
    )
    assert render("qwen3_5", answered[:1], None, None, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen3_5_refuses_a_conversation_without_user_query_or_with_a_late_system_message():
    with pytest.raises(Exception, match="needs a user message"):
        render("qwen3_5", [CONVERSATION[0], {"role": "assistant", "content": "Hi"}], None, None)
    with pytest.raises(Exception, match="system message only at the start"):
        render("qwen3_5", [*CONVERSATION[1:3], CONVERSATION[0], *CONVERSATION[3:]], None, None)


def test_gemma4_thinking_mode_opens_the_system_turn_and_leaves_the_thought_channel_to_the_model():
    assert render("gemma4", CONVERSATION[1:2], "<bos>", None, add_generation_prompt=True, enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWhat is two plus two?<turn|>\n<|turn>model\n"
    )


def test_gemma4_drops_thought_channels_from_answers_and_continues_a_model_turn():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel>thought\nbe brief<channel|>Hello"},
        {"role": "assistant", "content": "Again."},
    ]
    assert render("gemma4", messages, "<bos>", None) == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\nAgain.<turn|>\n"
    )
    # The dropped thought is part of the message to train, so the row is refused rather than trained without it.
    with pytest.raises(RowError, match="does not render message contents verbatim"):
        prepare("gemma4", ("<|turn>", "<turn|>"), [*CONVERSATION[:2], messages[1]])


def test_gemma4_refuses_tool_messages():
    with pytest.raises(Exception, match="cannot write a tool message"):
        render("gemma4", TOOL_EXCHANGE, "<bos>", None)


def test_jamba_and_nemotron_h_write_an_empty_system_turn_without_system_message():
    assert render("jamba", CONVERSATION[1:3], None, None) == (
        "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> What is two plus two?<|eom|>"
        "<|bom|><|assistant|> Four.<|eom|>"
    )
    assert render("nemotron_h", CONVERSATION[1:3], None, None) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>Four.<|im_end|>\n"
    )


def test_nemotron_h_truncates_earlier_thinking_and_groups_tool_results():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>plan</think>Hello"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>look it up</think>Checking."},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "12C"},
        {"role": "assistant", "content": "Rain, 12C."},
    ]
    assert render("nemotron_h", messages, None, None) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think></think>Hello"
        "<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>look it up</think>Checking."
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n12C\n</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n<think></think>Rain, 12C.<|im_end|>\n"
    )
    assert render("nemotron_h", messages[:1], None, None, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )


def test_exaone4_writes_tool_results_as_json_and_keeps_the_last_reasoning_only_when_asked():
    assert render("exaone4", TOOL_EXCHANGE, None, None) == (
        "[|user|]\nWeather?[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nChecking.[|endofturn|]\n"
        '[|tool|]\n<tool_result>{"result": "rain"}</tool_result>\n<tool_result>{"result": "12C"}</tool_result>'
        "[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nRain, 12C.[|endofturn|]\n"
    )
    answered = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello"},
    ]
    dropped = "[|user|]\nHi[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nHello[|endofturn|]\n"
    assert render("exaone4", answered, None, None) == dropped
    assert render("exaone4", answered, None, None, skip_think=False) == (
        "[|user|]\nHi[|endofturn|]\n[|assistant|]\n<think>\nsay hi\n</think>\n\nHello[|endofturn|]\n"
    )
    assert render("exaone4", answered[:1], None, None, add_generation_prompt=True, enable_thinking=True) == (
        "[|user|]\nHi[|endofturn|]\n[|assistant|]\n<think>\n"
    )


@pytest.mark.parametrize("name", ["llama3", "gemma3", "cohere", "qwen3_5", "gemma4"])
def test_families_that_trim_contents_trim_them(name):
    bos, eos, conversation, _ = EXPECTED[name]
    padded = [{**m, "content": f" {m['content']}\n"} if m["role"] != "system" else m for m in CONVERSATION]
    assert render(name, padded, bos, eos) == conversation


# Vision-language rows: every message's content is a list of parts; the first user message holds an image.
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
    {"role": "user", "content": [{"type": "image", "path": "red.png"}, {"type": "text", "text": U1}]},
    {"role": "assistant", "content": [{"type": "text", "text": A1}]},
]
IMAGE_RENDERINGS = {
    "gemma3": (
        "<bos>",
        "<bos><start_of_turn>user\nYou are terse.\n\n<start_of_image>What is two plus two?<end_of_turn>\n"
        "<start_of_turn>model\nFour.<end_of_turn>\n",
    ),
    "gemma3n": (
        "<bos>",
        "<bos><start_of_turn>user\nYou are terse.\n\n<image_soft_token>What is two plus two?<end_of_turn>\n"
        "<start_of_turn>model\nFour.<end_of_turn>\n",
    ),
    "llama4": (
        "<|begin_of_text|>",
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nYou are terse.<|eot|>"
        "<|header_start|>user<|header_end|>\n\n<|image|>What is two plus two?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\nFour.<|eot|>",
    ),
    # Llama 3.2 Vision: a conversation with images has no system turn (and no system message: see below).
    "llama3_2_vision": (
        "<|begin_of_text|>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>What is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>",
    ),
    "mistral_v7_tekken": (
        "<s>",
        "<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][INST][IMG]What is two plus two?[/INST]Four.</s>",
    ),
    "pixtral": ("<s>", "<s>[INST]You are terse.\n\n[IMG]What is two plus two?[/INST]Four.</s>"),
    "qwen2_vl": (
        None,
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n",
    ),
    "qwen3_5": (
        None,
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n",
    ),
    # Gemma 4 writes a system message of parts as each text part trimmed and followed by a space.
    "gemma4": (
        "<bos>",
        "<bos><|turn>system\nYou are terse. <turn|>\n<|turn>user\n<|image|>What is two plus two?<turn|>\n"
        "<|turn>model\nFour.<turn|>\n",
    ),
}
IMAGE_RENDERINGS["gemma4_unified"] = IMAGE_RENDERINGS["gemma4"]


def test_the_templates_that_write_images_are_the_ones_with_a_rendering_of_image_parts():
    assert {name for name, template in NAMED_TEMPLATES.items() if template.images} == set(IMAGE_RENDERINGS)


@pytest.mark.parametrize("name", sorted(IMAGE_RENDERINGS))
def test_renders_image_parts_with_the_family_image_token(name):
    bos, expected = IMAGE_RENDERINGS[name]
    messages = PARTS[1:] if name == "llama3_2_vision" else PARTS
    assert render(name, messages, bos, "</s>") == expected


def test_llama3_2_vision_refuses_a_system_message_beside_images_and_takes_the_renderers_date():
    with pytest.raises(Exception, match="no system message in a conversation with images"):
        render("llama3_2_vision", PARTS, "<|begin_of_text|>", None)
    assert render("llama3_2_vision", CONVERSATION[1:3], "", None, date_string="01 Jan 2026") == (
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 01 Jan 2026\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
    )


def test_a_text_only_template_refuses_content_parts_naming_the_templates_that_write_images():
    with pytest.raises(Exception, match="chat_template: llama3 writes text messages only") as err:
        render("llama3", PARTS, "<|begin_of_text|>", None)
    assert ", ".join(sorted(IMAGE_RENDERINGS)) in str(err.value)


def test_qwen2_vl_without_system_message_writes_the_default_one():
    assert render("qwen2_vl", PARTS[1:2], None, None, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_exaone_opens_a_conversation_without_system_message_with_an_empty_system_turn():
    assert render("exaone", CONVERSATION[1:3], None, None) == (
        "[|system|][|endofturn|]\n[|user|]What is two plus two?\n[|assistant|]Four.[|endofturn|]\n"
    )


def test_falcon_h1_writes_only_a_leading_system_message():
    messages = [*CONVERSATION[:3], {"role": "system", "content": "Be kind."}, *CONVERSATION[3:]]
    bos, eos, conversation, _ = EXPECTED["falcon_h1"]
    assert render("falcon_h1", messages, bos, eos) == conversation


# --- labels through hellbender's preparation path ----------------------------------------------------------


def prepare(name: str, markers: tuple[str, ...], messages=CONVERSATION, **entry):
    tok = build_tiny_tokenizer(extra_special_tokens=markers)
    cfg = validate_config(
        {
            "base_model": "hellbender/tiny-llama",
            "datasets": [{"path": "x.jsonl", "type": "chat_template", "chat_template": name, **entry}],
        }
    )
    ctx = format_context(cfg.datasets[0], cfg, tok)
    return tok, FORMATTERS["chat_template"]({"messages": messages}, ctx)


def trained_text(tok, labels) -> str:
    return tok.decode([label for label in labels if label != IGNORE])


@pytest.mark.parametrize(
    ("name", "markers", "expected"),
    [
        (
            "llama3",
            ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            "Four.<|eot_id|>Six, of course.<|eot_id|>",
        ),
        (
            "llama3_2_vision",
            ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            "Four.<|eot_id|>Six, of course.<|eot_id|>",
        ),
        (
            "granite",
            ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
            "Four.<|end_of_text|>Six, of course.<|end_of_text|>",
        ),
        ("phi_4", ("<|im_sep|>",), "Four.<|im_end|>Six, of course.<|im_end|>"),
        (
            "deepseek_v3",
            ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
            "Four.<｜end▁of▁sentence｜>Six, of course.<｜end▁of▁sentence｜>",
        ),
        (
            "cohere",
            (
                "<|START_OF_TURN_TOKEN|>",
                "<|END_OF_TURN_TOKEN|>",
                "<|SYSTEM_TOKEN|>",
                "<|USER_TOKEN|>",
                "<|CHATBOT_TOKEN|>",
            ),
            "Four.<|END_OF_TURN_TOKEN|>Six, of course.<|END_OF_TURN_TOKEN|>",
        ),
        # Mistral v1 and v2/v3 write a space before the answer; the token that holds it is part of the answer.
        ("mistral_v1", (), " Four.<|endoftext|> Six, of course.<|endoftext|>"),
        ("mistral_v2v3", (), " Four.<|endoftext|> Six, of course.<|endoftext|>"),
        ("gemma3", ("<start_of_turn>", "<end_of_turn>"), "Four.<end_of_turn>Six, of course.<end_of_turn>"),
        ("qwen3", ("<think>", "</think>"), "Four.<|im_end|>Six, of course.<|im_end|>"),
        ("phi_3", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "Four.<|end|>Six, of course.<|end|>"),
        # Templates that close the answer with the tokenizer's EOS (here the tiny tokenizer's `<|endoftext|>`).
        ("mistral_v3_tekken", ("[INST]", "[/INST]"), "Four.<|endoftext|>Six, of course.<|endoftext|>"),
        ("deepseek_v2", ("<｜User｜>", "<｜Assistant｜>"), "Four.<|endoftext|>Six, of course.<|endoftext|>"),
        # EXAONE: the user turn has no end token, the assistant's is `[|endofturn|]`.
        (
            "exaone",
            ("[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]"),
            "Four.[|endofturn|]Six, of course.[|endofturn|]",
        ),
        # The empty think blocks in front of the answers are the template's own text, never trained.
        (
            "exaone4",
            ("[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]", "<think>", "</think>"),
            "Four.[|endofturn|]Six, of course.[|endofturn|]",
        ),
        ("qwen3_5", ("<think>", "</think>"), "Four.<|im_end|>Six, of course.<|im_end|>"),
        ("nemotron_h", ("<think>", "</think>"), "Four.<|im_end|>Six, of course.<|im_end|>"),
        ("gemma4", ("<|turn>", "<turn|>"), "Four.<turn|>Six, of course.<turn|>"),
        ("gemma4_unified", ("<|turn>", "<turn|>"), "Four.<turn|>Six, of course.<turn|>"),
        # Jamba writes a space before each answer; the token that holds it is part of the answer.
        ("jamba", ("<|startoftext|>", "<|bom|>", "<|eom|>"), " Four.<|eom|> Six, of course.<|eom|>"),
    ],
)
def test_only_assistant_contents_and_their_end_of_turn_token_are_trained(name, markers, expected):
    tok, out = prepare(name, markers)
    # The rendered row is exactly what the tokenizer's own chat template machinery produces with this template.
    rendered = tok.apply_chat_template(CONVERSATION, chat_template=NAMED_TEMPLATES[name].jinja, tokenize=False)
    assert out["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert trained_text(tok, out["labels"]) == expected
    # Every marker of the template is one token (not pieces of text) in the prepared row.
    for marker in NAMED_TEMPLATES[name].markers:
        if marker in rendered:
            assert tok.convert_tokens_to_ids(marker) in out["input_ids"]


def test_llama3_labels_are_exactly_the_assistant_tokens():
    markers = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    tok, out = prepare("llama3", markers)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    expected: list[int] = []
    for message in CONVERSATION:
        trained = message["role"] == "assistant"
        header = ids(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")
        content = ids(message["content"])
        eot = ids("<|eot_id|>")
        expected += [IGNORE] * len(header) + (content + eot if trained else [IGNORE] * (len(content) + len(eot)))
    assert out["labels"] == expected


THINKING_MARKERS = ("<think>", "</think>")


@pytest.mark.parametrize(
    ("name", "trained"),
    [
        # Qwen3 / Qwen3.5 move the block into their own (`<think>\n` ... `\n</think>\n\n`); the opening is the
        # template's, what follows the reasoning up to the answer is trained with it.
        ("qwen3", "Four.<|im_end|>add\n</think>\n\nSix.<|im_end|>"),
        ("qwen3_5", "Four.<|im_end|>add\n</think>\n\nSix.<|im_end|>"),
        # Nemotron writes the content as it is: the reasoning keeps its own newlines.
        ("nemotron_h", "Four.<|im_end|>\nadd\n</think>\n\nSix.<|im_end|>"),
    ],
)
def test_a_think_block_written_in_the_last_answer_is_trained_where_the_template_puts_it(name, trained):
    messages = [*CONVERSATION[:4], {"role": "assistant", "content": "<think>\nadd\n</think>\n\nSix."}]
    tok, out = prepare(name, THINKING_MARKERS, messages)
    rendered = tok.apply_chat_template(messages, chat_template=NAMED_TEMPLATES[name].jinja, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\nadd\n</think>\n\nSix.<|im_end|>\n")
    assert out["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert trained_text(tok, out["labels"]) == trained


def test_a_think_block_the_template_drops_from_an_earlier_answer_is_not_trained():
    # Qwen3 keeps reasoning only after the last user query, as at inference; the earlier answer trains without it.
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": "<think>add</think>Four."}, *CONVERSATION[3:]]
    tok, out = prepare("qwen3", THINKING_MARKERS, messages)
    assert "add" not in tok.decode(out["input_ids"])
    assert trained_text(tok, out["labels"]) == "Four.<|im_end|>Six, of course.<|im_end|>"


def test_a_template_that_never_renders_a_written_think_block_is_refused():
    # EXAONE 4 drops think blocks from every answer unless `skip_think` is false: the reasoning would vanish.
    markers = ("[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]", *THINKING_MARKERS)
    messages = [*CONVERSATION[:4], {"role": "assistant", "content": "<think>\nadd\n</think>\n\nSix."}]
    with pytest.raises(ConfigError, match="drops the `<think>` block"):
        prepare("exaone4", markers, messages)


# --- choosing a template -----------------------------------------------------------------------------------


def test_a_tokenizer_without_the_template_markers_is_refused_naming_them():
    tok = build_tiny_tokenizer()
    with pytest.raises(ConfigError) as err:
        resolve_chat_template("llama3", None, tok)
    message = str(err.value)
    assert "`chat_template: llama3`" in message
    assert "`<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`" in message
    assert "tokenizer_default" in message


def test_the_check_counts_tokens_the_tokenizer_has_already():
    tok = build_tiny_tokenizer(extra_special_tokens=("<start_of_turn>", "<end_of_turn>"))
    assert resolve_chat_template("gemma3", None, tok) == NAMED_TEMPLATES["gemma3"].jinja
    with pytest.raises(ConfigError, match="`<end_of_turn>`"):
        resolve_chat_template("gemma3", None, build_tiny_tokenizer(extra_special_tokens=("<start_of_turn>",)))


def config(**keys) -> dict:
    return {"base_model": "hellbender/tiny-llama", "datasets": [{"path": "x.jsonl", "type": "chat_template"}], **keys}


def test_an_unknown_name_is_refused_with_the_known_names():
    with pytest.raises(ConfigError) as err:
        validate_config(config(chat_template="vicuna"))
    message = str(err.value)
    assert "`chat_template: vicuna` is not a chat template hellbender knows" in message
    for name in TEMPLATE_NAMES:
        assert f"`{name}`" in message
    assert f"`{FALLBACK_PREFIX}<name>`" in message


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("llava", "no end-of-turn token of its own (no EOS either)"),
        ("metharme", "closes only the conversation's last answer with EOS"),
        ("tokenizer_default_fallback_command_a", "long default preamble"),
        ("command_a_rag", "long default preamble"),
        ("alpaca", "use `type: alpaca`"),
    ],
)
def test_an_axolotl_template_that_is_not_shipped_is_refused_saying_why(name, reason):
    with pytest.raises(ConfigError) as err:
        validate_config(config(chat_template=name))
    message = str(err.value)
    assert f"`chat_template: {name}` is not offered (an Axolotl template hellbender deliberately" in message
    assert reason in message


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4", "gemma4_unified", "jamba", "exaone4", "nemotron_h"])
def test_axolotl_names_of_the_newer_families_are_shipped(name):
    assert validate_config(config(chat_template=name)).datasets[0].chat_template == name


def test_fallback_names_are_accepted_only_for_named_templates():
    cfg = validate_config(config(chat_template="tokenizer_default_fallback_llama3"))
    assert cfg.datasets[0].chat_template == "tokenizer_default_fallback_llama3"
    with pytest.raises(ConfigError, match="`chat_template: tokenizer_default_fallback_vicuna` is not a chat template"):
        validate_config(config(chat_template="tokenizer_default_fallback_vicuna"))


def test_fallback_picks_the_tokenizers_template_when_it_has_one_else_the_named_one():
    own = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    with_template = build_tiny_tokenizer(chat_template=own)
    assert resolve_chat_template("tokenizer_default_fallback_chatml", None, with_template) == own
    without = build_tiny_tokenizer(chat_template=None)
    assert not without.chat_template
    assert resolve_chat_template("tokenizer_default_fallback_chatml", None, without) == NAMED_TEMPLATES["chatml"].jinja
    # The fallback template's markers are checked like the named template's own.
    with pytest.raises(ConfigError, match="tokenizer_default_fallback_llama3"):
        resolve_chat_template("tokenizer_default_fallback_llama3", None, without)


def test_qwen2_vl_prepares_an_image_row_as_the_models_own_template_does(tmp_path):
    """Through the vision-language path (tiny Qwen2.5-VL, whose own template is ChatML with vision tokens): with a
    system message, `chat_template: qwen2_vl` gives the same tokens and labels as the model's template."""
    from PIL import Image

    from hellbender.data.formats.multimodal_chat import tokenize_row
    from hellbender.models.loading import load_tokenizer_and_processor

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")

    def setup(**entry):
        cfg = validate_config(
            {
                "base_model": "hellbender/tiny-qwen2.5-vl",
                "processor_type": "AutoProcessor",
                "datasets": [{"path": "rows.jsonl", "type": "chat_template", "image_base_dir": str(tmp_path), **entry}],
                "output_dir": str(tmp_path / "out"),
            }
        )
        tok, processor = load_tokenizer_and_processor(cfg)
        return tok, format_context(cfg.datasets[0], cfg, tok, processor)

    row = {"messages": [*PARTS, {"role": "user", "content": U2}, {"role": "assistant", "content": A2}]}
    tok, own = setup()
    _, named = setup(chat_template="qwen2_vl")
    assert named.chat_template == NAMED_TEMPLATES["qwen2_vl"].jinja != own.chat_template
    out_own, out_named = tokenize_row(row, own), tokenize_row(row, named)
    assert out_named["input_ids"] == out_own["input_ids"]
    assert out_named["labels"] == out_own["labels"]
    assert trained_text(tok, out_named["labels"]) == "Four.<|im_end|>Six, of course.<|im_end|>"


def test_fallback_takes_a_vision_models_template_kept_with_its_processor_only(tmp_path):
    """Many vision-language repos store the template in the processor's `chat_template.json` and none in the
    tokenizer's files: that is still the model's own template, which the fallback must pick."""
    import json
    import shutil
    from pathlib import Path

    from hellbender.models.loading import load_tokenizer_and_processor, resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("hellbender/tiny-qwen2.5-vl"), model)
    own = (model / "chat_template.jinja").read_text(encoding="utf-8")
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.json").write_text(json.dumps({"chat_template": own}), encoding="utf-8")
    assert "chat_template" not in json.loads(Path(model, "tokenizer_config.json").read_text(encoding="utf-8"))

    def load(name):
        cfg = validate_config(
            {
                "base_model": str(model),
                "processor_type": "AutoProcessor",
                "chat_template": name,
                "datasets": [{"path": "rows.jsonl", "type": "chat_template"}],
            }
        )
        return load_tokenizer_and_processor(cfg)

    tok, processor = load("tokenizer_default_fallback_chatml")
    assert processor.chat_template == tok.chat_template == own != NAMED_TEMPLATES["chatml"].jinja
    tok, processor = load("qwen2_vl")
    assert processor.chat_template == tok.chat_template == NAMED_TEMPLATES["qwen2_vl"].jinja


def test_drop_system_message_renders_and_trains_the_conversation_as_if_it_had_none():
    markers = ("<|im_start|>", "<|im_end|>")
    _, dropped = prepare("chatml", markers, drop_system_message=True)
    _, without = prepare("chatml", markers, messages=CONVERSATION[1:])
    _, kept = prepare("chatml", markers)
    assert dropped["input_ids"] == without["input_ids"] and dropped["labels"] == without["labels"]
    assert len(kept["input_ids"]) > len(dropped["input_ids"])
