"""Tiny Gemma 4 (`hellbender/tiny-gemma4-vlm`): Gemma 4's vision encoder and a Gemma 4 text model with
per-layer embeddings, sliding + full attention and shared K/V layers, all at toy sizes.

`build(target)` saves a `Gemma4ForConditionalGeneration` with random weights (seed 0), its tokenizer and its
processor into `target`. `AutoModelForImageTextToText.from_pretrained(target)` loads the model.

The processor, without torchvision: `Gemma4Processor` insists on a `Gemma4VideoProcessor`, a class that cannot
even be imported without torchvision, so `AutoProcessor.from_pretrained(target)` fails here
(ImportError: `Gemma4VideoProcessor requires the Torchvision library`). `load_processor(target)` is the documented way:
with torchvision it is plain `AutoProcessor.from_pretrained`; without, it loads the tokenizer, the PIL image
processor (`Gemma4ImageProcessorPil`) and the audio feature extractor through their Auto classes and joins
them in `Gemma4ProcessorWithoutVideo`, a `Gemma4Processor` whose only difference is that it accepts
`video_processor=None` (and refuses videos with a clear message). Its `save_pretrained` writes the same files
a real `Gemma4Processor` writes, with `processor_class: Gemma4Processor` and a `Gemma4VideoProcessor` config
(patch 4, 70 soft tokens, pooling 3), so a machine with torchvision loads the directory with `AutoProcessor`.

Image path (measured): the PIL image processor resizes every image, keeping its aspect ratio, to fill at most
`MAX_SOFT_TOKENS * POOLING_KERNEL_SIZE**2` = 630 patches of `PATCH_SIZE` 4 px with sides that are multiples of
`POOLING_KERNEL_SIZE * PATCH_SIZE` = 12 px: a 32x32 image becomes 96x96 = 24x24 patches (padded to 630 with
position -1), which the vision pooler averages 3x3 into 8x8 = 64 soft tokens. In the text, the chat template
writes one `IMAGE_TOKEN` per image and the processor replaces it with
`BOI_TOKEN + IMAGE_TOKEN * n + EOI_TOKEN` (n = 64 for a square image); the model scatters the vision
features into the `IMAGE_TOKEN` positions (`config.image_token_id`); BOI / EOI stay ordinary embedded tokens.

Chat format (Gemma turns; the template is written here, not copied):

    <start_of_turn>user\\n<image_soft_token>What is this?<end_of_turn>\\n<start_of_turn>model\\nA cat.<end_of_turn>\\n

Role `assistant` renders as `model`, every other role as itself (`system` included). A content is a string,
inserted verbatim (hellbender's placeholder-based turn locator relies on that), or a list of
`{"type": "text", "text": ...}` / `{"type": "image", ...}` parts, an image part rendering as `IMAGE_TOKEN`.
`add_generation_prompt` appends `<start_of_turn>model\\n`. There is no BOS token. The tokenizer's EOS stays
`<|endoftext|>`; the generation config stops on `<|endoftext|>` and `<end_of_turn>` (as Gemma's does).
"""

from __future__ import annotations

from pathlib import Path

from hellbender.models.fixes.gemma4 import Gemma4ProcessorWithoutVideo
from hellbender.models.tiny import build_tiny_tokenizer

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
# Named special tokens Gemma4Processor reads from the tokenizer (`tokenizer.image_token`, ...); all six must be
# registered even though this model has no audio tower.
IMAGE_TOKEN = "<image_soft_token>"
BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
AUDIO_TOKEN = "<audio_soft_token>"
BOA_TOKEN = "<start_of_audio>"
EOA_TOKEN = "<end_of_audio>"
# Gemma4Processor.__init__ adds this exact token to the tokenizer; registering it up front keeps the vocabulary
# (and so the model's embedding size) the same before and after the processor is built.
VIDEO_TOKEN = "<|video|>"
NAMED_TOKENS = {
    "image_token": IMAGE_TOKEN,
    "boi_token": BOI_TOKEN,
    "eoi_token": EOI_TOKEN,
    "audio_token": AUDIO_TOKEN,
    "boa_token": BOA_TOKEN,
    "eoa_token": EOA_TOKEN,
}

PATCH_SIZE = 4
POOLING_KERNEL_SIZE = 3  # Gemma 4's own value: the vision pooler averages 3x3 patches into one soft token
MAX_SOFT_TOKENS = 70  # the smallest budget Gemma4ImageProcessorPil accepts (70, 140, 280, 560, 1120)
# Patch positions index this table: a very wide image is at most (630 // 9) * 12 = 840 px = 210 patches wide.
POSITION_EMBEDDING_SIZE = 256

# Text model: 5 layers, 4 sliding : 1 full like Gemma-4-E2B but shorter; the last two layers reuse the K/V of the
# last earlier layer of their type, so layer 0 is plain, 1 and 2 store K/V, 3 and 4 reuse them.
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention")
NUM_KV_SHARED_LAYERS = 2
HEAD_DIM = 16
GLOBAL_HEAD_DIM = 32  # full-attention layers; without it they would default to 512
SLIDING_WINDOW = 16  # shorter than a conversation with one image (~80 tokens), so the window matters

# Written for this model. Every tag trims the template's own whitespace, so only the quoted strings and the message
# contents reach the output; contents are inserted verbatim (not stripped).
GEMMA4_CHAT_TEMPLATE = (
    """\
{%- macro render(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- elif part['type'] == 'image' -%}
        {{- '@IMAGE@' -}}
      {%- else -%}
        {{- raise_exception('Gemma 4 chat template: unsupported content part type ' ~ part['type']) -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '@SOT@' ~ role ~ '\\n' ~ render(message['content']) ~ '@EOT@\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '@SOT@model\\n' -}}
{%- endif -%}
""".replace("@IMAGE@", IMAGE_TOKEN)
    .replace("@SOT@", START_OF_TURN)
    .replace("@EOT@", END_OF_TURN)
)


def build_tokenizer():
    """The tiny BPE tokenizer with Gemma 4's named image / audio tokens, the turn markers and the template."""
    return build_tiny_tokenizer(
        extra_special_tokens=(START_OF_TURN, END_OF_TURN, VIDEO_TOKEN),
        chat_template=GEMMA4_CHAT_TEMPLATE,
        **NAMED_TOKENS,
    )


def build_processor(tokenizer=None):
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    image_processor = Gemma4ImageProcessorPil(
        patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=POOLING_KERNEL_SIZE
    )
    extra_special_tokens = list(tokenizer.extra_special_tokens)
    processor = Gemma4ProcessorWithoutVideo(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=GEMMA4_CHAT_TEMPLATE,
        image_seq_length=MAX_SOFT_TOKENS,
    )
    # Gemma4Processor.__init__ replaces the tokenizer's extra special tokens with just `<|video|>` (the tokens stay
    # special, unsplit and skipped by decode); put the full list back so the saved tokenizer_config lists them all.
    tokenizer.add_special_tokens({"extra_special_tokens": extra_special_tokens})
    return processor


def build_config(tokenizer):
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    vocab_size = len(tokenizer)
    text_config = Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        global_head_dim=GLOBAL_HEAD_DIM,
        num_kv_shared_layers=NUM_KV_SHARED_LAYERS,
        use_double_wide_mlp=True,  # as Gemma-4-E2B: the K/V-sharing layers get a twice-as-wide MLP
        sliding_window=SLIDING_WINDOW,
        hidden_size_per_layer_input=16,  # per-layer embeddings, as the E2B / E4B models have
        vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=30.0,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    vision_config = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH_SIZE,
        pooling_kernel_size=POOLING_KERNEL_SIZE,
        position_embedding_size=POSITION_EMBEDDING_SIZE,
    )
    ids = tokenizer.convert_tokens_to_ids
    return Gemma4Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        image_token_id=ids(IMAGE_TOKEN),
        boi_token_id=ids(BOI_TOKEN),
        eoi_token_id=ids(EOI_TOKEN),
        video_token_id=ids(VIDEO_TOKEN),
        audio_token_id=ids(AUDIO_TOKEN),
        boa_token_id=ids(BOA_TOKEN),
        eoa_token_index=ids(EOA_TOKEN),
        tie_word_embeddings=True,
    )


def build(target: Path) -> None:
    """Save the tiny Gemma 4 model, its tokenizer and its processor into `target`."""
    import torch
    from transformers import Gemma4ForConditionalGeneration, GenerationConfig

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    config = build_config(tokenizer)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(target)
    processor.save_pretrained(target)  # also writes the tokenizer files and the chat template


def build_text(target: Path) -> None:
    """Save the text-only tiny Gemma 4 (`hellbender/tiny-gemma4`): the same language model as the image-text one
    (sliding + full attention, shared K/V, per-layer embeddings) as a `Gemma4ForCausalLM`, with its tokenizer."""
    import torch
    from transformers import Gemma4ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    Gemma4ForCausalLM(build_config(tokenizer).text_config).save_pretrained(target)
    tokenizer.save_pretrained(target)
