"""The built-in tiny vision-language models as the tests see them: hub-style names, how each family's processor
loads, and the facts the shared tests (tests/test_tiny_vlms.py) check per family. The fixtures that load them are in
tests/conftest.py (`tiny_vlm`, `tiny_vlm_dir`, `tiny_vlm_processor`, `tiny_vlm_model`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GEMMA4 = "hellbender/tiny-gemma4-vlm"
QWEN = "hellbender/tiny-qwen2.5-vl"
QWEN3 = "hellbender/tiny-qwen3-vl"
LLAVA = "hellbender/tiny-llava"
IDEFICS3 = "hellbender/tiny-idefics3"


def _auto_processor(path: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def _gemma4_processor(path: Path):  # AutoProcessor needs torchvision for Gemma 4
    from hellbender.models.fixes.gemma4 import load_processor

    return load_processor(path)


def _qwen_processor(path: Path):  # likewise for the stock Qwen2.5-VL processor (its video processor)
    from hellbender.models.fixes.qwen2_5_vl import load_processor

    return load_processor(path)


def _qwen3_processor(path: Path):  # and for Qwen3-VL's
    from hellbender.models.fixes.qwen3_vl import load_processor

    return load_processor(path)


@dataclass(frozen=True)
class TinyVLM:
    family: str  # the test id
    name: str  # `base_model` value, a key of hellbender.models.tiny.TINY_MODELS
    load_processor: Callable[[Path], object]
    image_size: tuple[int, int]  # (width, height) of the test images
    tokens_per_image: int  # placeholder tokens the processor expands one such image into
    label_masked_tokens: tuple[str, ...]  # tokens a trainer never trains on, besides padding
    trained_by_an_image_row: tuple[str, ...]  # parameters a row with an image must give a gradient
    untrained_by_an_image_row: tuple[str, ...] = ()  # parameters it must not reach
    vision_modules: tuple[str, ...] = ()  # submodules a text-only row must not reach
    text_only_keys: frozenset[str] = frozenset({"input_ids", "attention_mask"})  # what the processor gives text
    flat_images: bool = True  # the processor takes a flat image list for a batch (else one list per row only)

    def image(self, seed: int):
        """A random-noise RGB image of `image_size`; different seeds give different images."""
        import numpy as np
        from PIL import Image

        width, height = self.image_size
        return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


TINY_VLMS = {
    spec.family: spec
    for spec in (
        TinyVLM(
            family="gemma4",
            name=GEMMA4,
            load_processor=_gemma4_processor,
            image_size=(32, 32),
            tokens_per_image=64,  # resized to 96 x 96 = 24 x 24 patches of 4 px, pooled 3 x 3 -> 8 x 8 soft tokens
            label_masked_tokens=("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
            trained_by_an_image_row=(
                "model.vision_tower.patch_embedder.input_proj.weight",
                "model.vision_tower.encoder.layers.1.mlp.down_proj.linear.weight",
                "model.embed_vision.embedding_projection.weight",
                "model.language_model.embed_tokens_per_layer.weight",
                "model.language_model.layers.1.self_attn.k_proj.weight",  # stores K/V that layer 3 reuses
                "model.language_model.layers.3.self_attn.q_proj.weight",  # a K/V-sharing layer
                "model.language_model.layers.4.mlp.up_proj.weight",
                "model.language_model.embed_tokens.weight",  # tied to lm_head
            ),
            vision_modules=("model.vision_tower", "model.embed_vision"),
            text_only_keys=frozenset({"input_ids", "attention_mask", "mm_token_type_ids"}),
            flat_images=False,
        ),
        TinyVLM(
            family="idefics3",
            name=IDEFICS3,
            load_processor=_auto_processor,
            image_size=(64, 64),
            tokens_per_image=5 * 4,  # 2 x 2 tiles + a global view, (32 / 8)^2 patches each, pixel shuffle 2
            label_masked_tokens=("<image>",),
            trained_by_an_image_row=(
                "model.vision_model.embeddings.patch_embedding.weight",
                "model.vision_model.encoder.layers.0.self_attn.q_proj.weight",
                "model.connector.modality_projection.proj.weight",
                "model.text_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ),
            vision_modules=("model.vision_model", "model.connector"),
        ),
        TinyVLM(
            family="llava",
            name=LLAVA,
            load_processor=_auto_processor,
            image_size=(50, 40),  # any size is resized and cropped to 32 x 32
            tokens_per_image=16,  # (32 // 8) ** 2 patches; CLIP's CLS is counted (+1) and dropped ("default")
            label_masked_tokens=("<image>",),
            trained_by_an_image_row=(
                "model.multi_modal_projector.linear_1.weight",
                "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ),
            # LLaVA-1.5 reads the vision tower's second-to-last layer (`vision_feature_layer=-2`), so its last layer
            # and post_layernorm never get a gradient: "every trainable parameter changes" checks must exclude them.
            untrained_by_an_image_row=(
                "model.vision_tower.encoder.layers.1.mlp.fc1.weight",
                "model.vision_tower.post_layernorm.weight",
            ),
            vision_modules=("model.vision_tower", "model.multi_modal_projector"),
        ),
        TinyVLM(
            family="qwen2.5-vl",
            name=QWEN,
            load_processor=_qwen_processor,
            image_size=(32, 32),
            tokens_per_image=4,  # resized to 16 x 16 (max_pixels=256): 4 x 4 patches of 4 px, merged 2 x 2
            label_masked_tokens=("<|image_pad|>",),
            trained_by_an_image_row=(
                "model.visual.patch_embed.proj.weight",
                "model.visual.merger.mlp.2.weight",
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ),
            vision_modules=("model.visual",),
            text_only_keys=frozenset({"input_ids", "attention_mask", "mm_token_type_ids"}),
        ),
        TinyVLM(
            family="qwen3-vl",
            name=QWEN3,
            load_processor=_qwen3_processor,
            image_size=(32, 32),
            tokens_per_image=4,  # as the tiny Qwen2.5-VL: 4 x 4 patches of 4 px, merged 2 x 2
            label_masked_tokens=("<|image_pad|>",),
            trained_by_an_image_row=(
                "model.visual.patch_embed.proj.weight",
                "model.visual.pos_embed.weight",
                "model.visual.merger.linear_fc2.weight",
                "model.visual.deepstack_merger_list.0.linear_fc2.weight",  # added to the first language layer
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ),
            vision_modules=("model.visual",),
            text_only_keys=frozenset({"input_ids", "attention_mask", "mm_token_type_ids"}),
        ),
    )
}


def training_labels(batch, processor, spec: TinyVLM):
    """Labels as a trainer builds them: padding and the family's image tokens are ignored (-100)."""
    import torch

    labels = batch["input_ids"].clone()
    masked = torch.tensor(processor.tokenizer.convert_tokens_to_ids(list(spec.label_masked_tokens)))
    labels[torch.isin(labels, masked) | (batch["attention_mask"] == 0)] = -100
    return labels
