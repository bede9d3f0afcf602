"""The tiny Idefics3 (SmolVLM-style) model: it loads through the Auto classes like a hub checkpoint, its processor
expands `<image>` into tiles with row/column markers, and it trains on rows with several images, no image, or text only."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.parametrize("tiny_vlm", ["idefics3"], indirect=True)  # the fixtures are in conftest.py

IMAGE_TOKENS_PER_TILE = 4  # (32 / 8)^2 patches, pixel shuffle 2


def _image(seed: int, height: int = 64, width: int = 64):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tokens(processor, ids) -> list[str]:
    return processor.tokenizer.convert_ids_to_tokens(list(ids))


def test_auto_classes_load_the_saved_model_and_processor(tiny_vlm_processor, tiny_vlm_model):
    from transformers import Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

    from hellbender.models.tiny_vlm.idefics3 import CHAT_TEMPLATE

    processor, model = tiny_vlm_processor, tiny_vlm_model
    assert type(processor) is Idefics3Processor
    assert type(processor.image_processor) is Idefics3ImageProcessorPil  # no torchvision needed
    assert type(model) is Idefics3ForConditionalGeneration
    assert processor.chat_template == CHAT_TEMPLATE
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE
    tokenizer = processor.tokenizer
    assert tokenizer.eos_token == "<end_of_utterance>"
    assert tokenizer.pad_token == "<|pad|>"
    # Every token the processor emits is one known special token, and the model's ids agree with the tokenizer's.
    for token in ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<|im_start|>"]:
        assert tokenizer.tokenize(token) == [token]
    for i in range(1, 7):
        for j in range(1, 7):
            assert tokenizer.tokenize(f"<row_{i}_col_{j}>") == [f"<row_{i}_col_{j}>"]
    assert tokenizer.unk_token_id not in processor.row_col_ids
    assert len(set(processor.row_col_ids)) == 36
    assert model.config.image_token_id == processor.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert model.config.text_config.vocab_size == len(tokenizer)
    assert processor.image_seq_len == model.model.image_seq_len == IMAGE_TOKENS_PER_TILE
    assert tokenizer.decode(tokenizer("<|im_start|>User:<image>hi")["input_ids"], skip_special_tokens=True) == "User:hi"


def test_chat_template_renders_images_and_capitalised_roles(tiny_vlm_processor):
    processor = tiny_vlm_processor
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "answer"},
    ]
    expected = (
        "<|im_start|>User:<image>What is this?<end_of_utterance>\n<|im_start|>Assistant: answer<end_of_utterance>\n"
    )
    assert processor.apply_chat_template(messages, tokenize=False) == expected
    assert processor.tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert processor.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>User:<image>What is this?<end_of_utterance>\n<|im_start|>Assistant:"
    )
    mixed = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "C"}]},
        {"role": "user", "content": "<image>D"},
    ]
    assert processor.apply_chat_template(mixed, tokenize=False) == (
        "<|im_start|>System: Be brief.<end_of_utterance>\n"
        "<|im_start|>User: A<image>B<end_of_utterance>\n"
        "<|im_start|>Assistant: C<end_of_utterance>\n"
        "<|im_start|>User:<image>D<end_of_utterance>\n"
    )


def test_one_image_expands_into_row_col_tiles_and_a_global_view(tiny_vlm_processor):
    processor = tiny_vlm_processor
    batch = processor(text="<|im_start|>User:<image>Hi", images=[_image(0)], return_tensors="pt")
    tile = ["<image>"] * IMAGE_TOKENS_PER_TILE
    newline = processor.tokenizer.tokenize("\n")
    fake = "<fake_token_around_image>"
    expansion = (
        [fake, "<row_1_col_1>", *tile, fake, "<row_1_col_2>", *tile, *newline]
        + [fake, "<row_2_col_1>", *tile, fake, "<row_2_col_2>", *tile, *newline]
        + [*newline, fake, "<global-img>", *tile, fake]
    )
    prefix = processor.tokenizer.tokenize("<|im_start|>User:")
    suffix = processor.tokenizer.tokenize("Hi")
    assert _tokens(processor, batch["input_ids"][0]) == prefix + expansion + suffix
    assert expansion.count("<image>") == 5 * IMAGE_TOKENS_PER_TILE
    assert batch["attention_mask"].tolist() == [[1] * len(prefix + expansion + suffix)]
    # 2x2 tiles + the global view, each 32x32 pixels, with a pixel mask.
    assert tuple(batch["pixel_values"].shape) == (1, 5, 3, 32, 32)
    assert tuple(batch["pixel_attention_mask"].shape) == (1, 5, 32, 32)
    assert bool(batch["pixel_attention_mask"].all())
    # transformers' own token count for an image of that size agrees (used by vLLM-style budgeting).
    assert processor._get_num_multimodal_tokens(image_sizes=[(64, 64)]).num_image_tokens == [len(expansion)]


def test_tall_image_and_unsplit_image(tiny_vlm_processor):
    processor = tiny_vlm_processor
    tall = processor(text="<image>", images=[_image(0, height=64, width=32)])
    tokens = _tokens(processor, tall["input_ids"][0])
    markers = [t for t in tokens if t.startswith("<row_")]
    assert markers == ["<row_1_col_1>", "<row_2_col_1>"]
    assert tokens.count("<image>") == 3 * IMAGE_TOKENS_PER_TILE
    unsplit = processor(text="<image>", images=[_image(0)], do_image_splitting=False, return_tensors="pt")
    assert _tokens(processor, unsplit["input_ids"][0]) == (
        ["<fake_token_around_image>", "<global-img>"]
        + ["<image>"] * IMAGE_TOKENS_PER_TILE
        + ["<fake_token_around_image>"]
    )
    assert tuple(unsplit["pixel_values"].shape) == (1, 1, 3, 32, 32)


def test_two_images_in_one_row(tiny_vlm_processor, tiny_vlm_model):
    processor, model = tiny_vlm_processor, tiny_vlm_model
    batch = processor(
        text="<image>left<image>right", images=[_image(1), _image(2, height=64, width=32)], return_tensors="pt"
    )
    tokens = _tokens(processor, batch["input_ids"][0])
    assert tokens.count("<global-img>") == 2
    assert tokens.count("<image>") == (5 + 3) * IMAGE_TOKENS_PER_TILE
    # 5 tiles for the square image + 3 for the tall one, in one row of pixel_values.
    assert tuple(batch["pixel_values"].shape) == (1, 8, 3, 32, 32)
    out = model(**batch, labels=batch["input_ids"])
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    model.zero_grad()


def test_batch_where_one_row_has_no_image(tiny_vlm_processor, tiny_vlm_model):
    import torch

    processor, model = tiny_vlm_processor, tiny_vlm_model
    texts = ["<image>x y", "no image here"]
    flat = processor(text=texts, images=[_image(3)], padding=True, return_tensors="pt")
    nested = processor(text=texts, images=[[_image(3)], []], padding=True, return_tensors="pt")
    assert flat.keys() == nested.keys() == {"input_ids", "attention_mask", "pixel_values", "pixel_attention_mask"}
    for key in flat:
        assert torch.equal(flat[key], nested[key]), key
    # The image-less row gets all-zero padding images (dropped by the model) with an all-zero pixel mask.
    assert tuple(flat["pixel_values"].shape) == (2, 5, 3, 32, 32)
    assert not flat["pixel_values"][1].any() and not flat["pixel_attention_mask"][1].any()
    assert flat["pixel_attention_mask"][0].all()
    assert flat["input_ids"][1].tolist().count(processor.image_token_id) == 0

    # The padding images break nothing: the loss is finite and backward runs. (That each row gives the logits it
    # gives alone is tested for every family in test_tiny_vlms.py.)
    labels = flat["input_ids"].masked_fill(flat["attention_mask"] == 0, -100)
    model.zero_grad()
    out = model(**flat, labels=labels)
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    model.zero_grad()


def test_vision_modules_and_how_they_are_called(tiny_vlm_processor, tiny_vlm_model):
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    processor, model = tiny_vlm_processor, tiny_vlm_model
    assert isinstance(model.model.vision_model, Idefics3VisionTransformer)
    assert isinstance(model.model.connector, Idefics3Connector)
    calls = {}

    def record(name):
        def hook(module, args, kwargs):
            calls[name] = (len(args), sorted(kwargs))

        return hook

    handles = [
        model.model.vision_model.register_forward_pre_hook(record("vision_model"), with_kwargs=True),
        model.model.connector.register_forward_pre_hook(record("connector"), with_kwargs=True),
    ]
    try:
        model(**processor(text="<image>", images=[_image(4)], return_tensors="pt"))
    finally:
        for handle in handles:
            handle.remove()
    # vision_model gets keyword arguments only; the connector one positional tensor.
    assert calls["vision_model"][0] == 0
    assert {"pixel_values", "patch_attention_mask"} <= set(calls["vision_model"][1])
    assert calls["connector"] == (1, [])
