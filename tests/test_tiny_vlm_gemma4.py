"""The tiny Gemma 4 VLM built in code: it saves, loads back (the model through `AutoModelForImageTextToText`, the
processor through `gemma4.load_processor`, since `AutoProcessor` needs torchvision for Gemma 4), renders Gemma turns and
expands each image placeholder into `<start_of_image>` + soft tokens + `<end_of_image>`. That it trains with one image,
two images or none, through sliding / full attention and shared K/V layers, is tested for every family in
test_tiny_vlms.py."""

from __future__ import annotations

import json

import pytest

from hellbender.models.fixes import gemma4 as gemma4_fix
from hellbender.models.tiny_vlm import gemma4

pytestmark = pytest.mark.parametrize("tiny_vlm", ["gemma4"], indirect=True)  # the fixtures are in conftest.py

IMAGE_ID, BOI_ID, EOI_ID = 512, 513, 514  # first ids after the tiny tokenizer's 512 base tokens (the named ones)
N = 64  # a square image: resized to 96 x 96 = 24 x 24 patches of 4 px, pooled 3 x 3 -> 8 x 8 soft tokens
MAX_PATCHES = 630  # 70 soft tokens * 3 * 3: pixel_values are padded to this many patches
PATCH_DIM = 3 * 4 * 4


def _image(color):
    from PIL import Image

    return Image.new("RGB", (32, 32), color)


RED, BLUE = (220, 20, 20), (20, 20, 220)


def _ids(processor, text: str) -> list[int]:
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat(*images) -> list[dict]:
    parts = []
    for i, image in enumerate(images):
        parts += [{"type": "image", "image": image}, {"type": "text", "text": f"Image {i}."}]
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Squares."}]},
    ]


def test_processor_and_model_load_back_consistently(tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model):
    from transformers import AutoProcessor, AutoTokenizer, Gemma4ForConditionalGeneration, Gemma4Processor
    from transformers.utils import is_torchvision_available

    gemma4_dir, processor, model = tiny_vlm_dir, tiny_vlm_processor, tiny_vlm_model
    assert isinstance(processor, Gemma4Processor)
    if is_torchvision_available():
        assert type(processor) is Gemma4Processor
    else:
        assert type(processor) is gemma4_fix.Gemma4ProcessorWithoutVideo and processor.video_processor is None
        assert type(processor.image_processor).__name__ == "Gemma4ImageProcessorPil"
        with pytest.raises(ImportError, match="Torchvision"):  # why load_processor exists
            AutoProcessor.from_pretrained(gemma4_dir)
    saved = json.loads((gemma4_dir / "processor_config.json").read_text())
    assert saved["processor_class"] == "Gemma4Processor"  # what AutoProcessor picks where torchvision exists
    assert saved["video_processor"]["video_processor_type"] == "Gemma4VideoProcessor"
    assert type(model) is Gemma4ForConditionalGeneration

    # The tokens Gemma4Processor reads from the tokenizer, their ids and the model's config agree.
    assert (processor.image_token, processor.boi_token, processor.eoi_token) == (
        "<image_soft_token>",
        "<start_of_image>",
        "<end_of_image>",
    )
    assert processor.image_token_id == IMAGE_ID == model.config.image_token_id
    assert processor.tokenizer.convert_tokens_to_ids([processor.boi_token, processor.eoi_token]) == [BOI_ID, EOI_ID]
    assert (model.config.boi_token_id, model.config.eoi_token_id) == (BOI_ID, EOI_ID)
    assert processor.video_token_id == model.config.video_token_id
    assert processor.audio_token_id == model.config.audio_token_id
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert model.config.text_config.pad_token_id == processor.tokenizer.pad_token_id
    for token in ("<start_of_turn>", "<end_of_turn>", "<image_soft_token>", "<start_of_image>"):
        (token_id,) = _ids(processor, token)  # one special token, never split by the BPE
        assert processor.tokenizer.added_tokens_decoder[token_id].special
    tokenizer = AutoTokenizer.from_pretrained(gemma4_dir)
    assert processor.chat_template == tokenizer.chat_template == gemma4.GEMMA4_CHAT_TEMPLATE
    assert tokenizer.image_token == processor.image_token and tokenizer.boi_token == processor.boi_token
    assert "<end_of_turn>" in tokenizer.extra_special_tokens

    # Text model: sliding and full layers, per-layer head dims, and K/V shared by the last layers.
    text = model.config.text_config
    assert text.num_kv_shared_layers > 0
    assert {"sliding_attention", "full_attention"} == set(text.layer_types)
    assert text.per_layer_config[2].head_dim == 32 and text.per_layer_config[0].head_dim == 16
    layers = model.model.language_model.layers
    assert not hasattr(layers[3].self_attn, "k_proj") and not hasattr(layers[4].self_attn, "k_proj")
    assert (model.config.vision_config.patch_size, processor.image_processor.max_soft_tokens) == (4, 70)


def test_loaded_processor_saves_the_same_directory(tiny_vlm_dir, tiny_vlm_processor, tmp_path):
    gemma4_dir, processor = tiny_vlm_dir, tiny_vlm_processor
    processor.save_pretrained(tmp_path)  # e.g. next to a fine-tuned checkpoint
    assert (tmp_path / "chat_template.jinja").read_text() == (gemma4_dir / "chat_template.jinja").read_text()
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "Gemma4Processor"
    again = gemma4_fix.load_processor(tmp_path)
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert again.image_processor.to_dict() == processor.image_processor.to_dict()
    assert (again.image_token, again.boi_token, again.eoi_token) == (
        processor.image_token,
        processor.boi_token,
        processor.eoi_token,
    )


def test_chat_template_renders_gemma_turns(tiny_vlm_processor):
    processor = tiny_vlm_processor
    text = processor.apply_chat_template(_chat(_image(RED)), tokenize=False)
    assert text == (
        "<start_of_turn>user\n<image_soft_token>Image 0.What is this?<end_of_turn>\n"
        "<start_of_turn>model\nSquares.<end_of_turn>\n"
    )
    # String contents (what hellbender's data pipeline passes) are inserted verbatim; other roles keep their name.
    strings = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "<image_soft_token>\n hi"},
        {"role": "assistant", "content": " ok\n"},
        {"role": "user", "content": "more"},
    ]
    expected = (
        "<start_of_turn>system\n Be brief. <end_of_turn>\n<start_of_turn>user\n<image_soft_token>\n hi<end_of_turn>\n"
        "<start_of_turn>model\n ok\n<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\n"
    )
    assert processor.apply_chat_template(strings, tokenize=False, add_generation_prompt=True) == expected
    assert processor.tokenizer.apply_chat_template(strings, tokenize=False, add_generation_prompt=True) == expected
    with pytest.raises(Exception, match="unsupported content part type video"):
        processor.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)


def test_processor_expands_the_image_token(tiny_vlm_processor):
    processor = tiny_vlm_processor
    text = processor.apply_chat_template(_chat(_image(RED)), tokenize=False)
    enc = processor(text=[text], images=[[_image(RED)]], return_tensors="pt")
    head, tail = text.split("<image_soft_token>")
    expected = _ids(processor, head) + [BOI_ID] + [IMAGE_ID] * N + [EOI_ID] + _ids(processor, tail)
    assert enc["input_ids"][0].tolist() == expected
    assert enc["mm_token_type_ids"][0].tolist() == [int(i == IMAGE_ID) for i in expected]  # BOI / EOI are text
    assert tuple(enc["pixel_values"].shape) == (1, MAX_PATCHES, PATCH_DIM)
    positions = enc["image_position_ids"][0]
    assert (positions == -1).all(-1).sum().item() == MAX_PATCHES - 24 * 24  # padding patches
    assert positions.max().item() == 23
    # The processor expands the image token, not `<start_of_image>`: a template writing BOI would be refused.
    with pytest.raises(ValueError, match="number of <image_soft_token> tokens"):
        processor(text=["<start_of_image>hi"], images=[[_image(RED)]])


def test_two_images_expand_into_two_bracketed_blocks(tiny_vlm_processor):
    """Each image: `<start_of_image>` + its soft tokens + `<end_of_image>`, and its own padded patch row. (The model
    side of two images in a row is tested for every family in test_tiny_vlms.py.)"""
    processor = tiny_vlm_processor
    text = processor.apply_chat_template(_chat(_image(RED), _image(BLUE)), tokenize=False)
    assert text.count("<image_soft_token>") == 2
    enc = processor(text=[text], images=[[_image(RED), _image(BLUE)]], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    assert ids.count(IMAGE_ID) == 2 * N and ids.count(BOI_ID) == 2 and ids.count(EOI_ID) == 2
    assert tuple(enc["pixel_values"].shape) == (2, MAX_PATCHES, PATCH_DIM)
