"""Vision-language training end to end on the built-in tiny VLMs (CPU, fp32): the bundled coloured-squares task is
learnt from the image, adapters land where they should, and the training invariants (activation checkpointing,
gradient accumulation, frozen vision modules, text-only rows, exact resume) hold for the multimodal path."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.conftest import EXAMPLES, write_jsonl
from tests.helpers import (
    SHAPES_DATA,
    StepSnapshot,
    StopAt,
    cli_train,
    final_weights,
    logged_losses,
    vlm_config,
)
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN

CHAT_DATA = EXAMPLES / "data" / "chat.jsonl"
# The colours of the bundled dataset, as scripts/make_example_data.py draws them.
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}
# Where each tiny model keeps its language model, and names that only its vision side / projector uses.
LANGUAGE_MODEL = {
    GEMMA4: "model.language_model.",
    QWEN: "model.language_model.",
    LLAVA: "model.language_model.",
    IDEFICS3: "model.text_model.",
}
VISION_PARTS = ("vision_tower", "embed_vision", "visual", "multi_modal_projector", "connector", "vision_model")


def model_dir(name: str) -> Path:
    from hellbender.models.tiny import tiny_model_dir

    return Path(name) if Path(name).is_dir() else tiny_model_dir(name)


def square(colour: str, x: int, y: int):
    """A held-out image drawn like the bundled ones: a 16x16 square of `colour` on white, 32x32 pixels."""
    from PIL import Image

    img = Image.new("RGB", (32, 32), (255, 255, 255))
    img.paste(COLOURS[colour], (x, y, x + 16, y + 16))
    return img


def load_trained(cfg: dict):
    """The processor hellbender trained with, and base model + saved adapter loaded with plain transformers / PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from hellbender.models.loading import load_tokenizer_and_processor

    _, processor = load_tokenizer_and_processor(validate_config(cfg))
    base = AutoModelForImageTextToText.from_pretrained(model_dir(cfg["base_model"]), dtype=torch.float32)
    return processor, PeftModel.from_pretrained(base, cfg["output_dir"]).eval()


@torch.no_grad()
def colour_scores(model, processor, image) -> torch.Tensor:
    """Log-probability of the answer "The square is <colour>." for each colour, given `image`."""
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}
    prompt = processor.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
    texts = [
        processor.apply_chat_template(
            [question, {"role": "assistant", "content": [{"type": "text", "text": f"The square is {c}."}]}],
            tokenize=False,
        )
        for c in COLOURS
    ]
    assert all(t.startswith(prompt) for t in texts)
    kwargs = dict(padding=True, add_special_tokens=False, return_tensors="pt")
    prompt_len = processor(text=[prompt], images=[[image]], **kwargs)["input_ids"].shape[1]
    batch = processor(text=texts, images=[[image]] * len(texts), **kwargs)
    logprobs = torch.log_softmax(model(**batch).logits[:, :-1].float(), -1)
    token_lp = logprobs.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    answer = batch["attention_mask"][:, 1:].clone()
    answer[:, : prompt_len - 1] = 0  # only the answer's tokens count
    return (token_lp * answer).sum(1)


@pytest.fixture(scope="module")
def seeing_gemma4(tmp_path_factory) -> Path:
    """The built-in tiny Gemma 4 with its patch projection scaled up 200x (nothing else changed).

    At its random initialisation the tiny Gemma 4 vision tower is nearly colour-blind: the patch projection (std 0.02)
    is dwarfed by the position-embedding table (std 1), so the image features of a red and a blue square differ by
    about 3 % and the logits by at most 0.02. Trained as is (60-150 steps, LoRA, with `vision_tower` or `embed_vision`
    as modules to save), it only learnt the colour prior: the same scores for every held-out image. Scaling the
    projection makes the pixels visible; the architecture and the code path are unchanged.
    """
    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("seeing-gemma4")
    shutil.copytree(model_dir(GEMMA4), target, dirs_exist_ok=True)
    weights = load_file(target / "model.safetensors")
    weights["model.vision_tower.patch_embedder.input_proj.weight"] *= 200
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


# --- 1. the image task is learnt, from the image ------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, steps, learning_rate, modules_to_save, min_correct",
    [
        # Gemma 4 tells the colours apart by 100 steps, but overcoming the colour prior for the rarest colour (blue is
        # in 14 of 60 rows) takes longer: at 100 steps all 12 held-out images were right on 2 of 4 seeds tried, 8 of 12
        # on the others; at 150 steps 12 of 12 on 3 of 3 seeds (smallest margin 1.2 nats).
        ("gemma4", 150, 1e-3, ["embed_tokens", "lm_head"], 12),
        # Qwen2.5-VL at 150 steps and 3e-3 gave 12 of 12 on 4 of 4 seeds on one CPU but 11 (and 9 at 200 steps) on
        # an AMD EPYC: too fast to be stable. At 300 steps and 1e-3, 12 of 12 on 3 of 3 seeds there.
        ("qwen2.5-vl", 300, 1e-3, ["embed_tokens", "lm_head"], 12),
    ],
)
def test_vlm_learns_the_colour_of_the_square_from_the_image(
    tmp_path, request, family, steps, learning_rate, modules_to_save, min_correct
):
    base_model = str(request.getfixturevalue("seeing_gemma4")) if family == "gemma4" else QWEN
    cfg = vlm_config(
        tmp_path,
        base_model,
        adapter="lora",
        lora_r=16,
        lora_alpha=32,
        lora_target_linear=True,
        lora_modules_to_save=modules_to_save,
        max_steps=steps,
        learning_rate=learning_rate,
        save_steps=1000,  # no intermediate checkpoints (time)
    )
    cli_train(tmp_path, cfg)
    losses = list(logged_losses(cfg["output_dir"]).values())
    assert len(losses) == steps
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.1 * first, losses

    processor, model = load_trained(cfg)
    rng = random.Random(1234)
    held_out = [(c, square(c, rng.randint(0, 16), rng.randint(0, 16))) for c in COLOURS for _ in range(4)]
    scores = torch.stack([colour_scores(model, processor, image) for _, image in held_out])  # [image, colour word]
    truth = torch.tensor([list(COLOURS).index(c) for c, _ in held_out])
    # The image decides: each colour word is much more likely on the images of that colour than on the others. An
    # image-blind model gives every image the same scores, so a margin of 0 (seen here: 1.7 to 6 nats, by seed).
    for w, word in enumerate(COLOURS):
        margin = scores[truth == w, w].mean() - scores[truth != w, w].mean()
        assert margin > 1.0, (word, scores.tolist())
    # Chance is 4 of 12, and an image-blind model answers the same colour for every image: exactly 4.
    correct = int((scores.argmax(1) == truth).sum())
    assert correct >= min_correct, scores.tolist()


# --- 2. the vision tower as a module to save ---------------------------------------------------------------------


def test_vision_tower_as_module_to_save_trains_saves_and_reloads_with_plain_peft(tmp_path):
    """Gemma 4 calls its vision tower with keyword arguments only, which PEFT's ModulesToSaveWrapper must pass on."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    base_dir = model_dir(GEMMA4)
    cfg = validate_config(
        vlm_config(tmp_path, GEMMA4, adapter="lora", lora_modules_to_save=["vision_tower"], max_steps=2)
    )
    train(cfg)
    out = Path(cfg.output_dir)
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["vision_tower"]
    saved = load_file(out / "adapter_model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    # peft 0.21 saves a module to save under the base model's own names (without `modules_to_save.default`).
    saved_vision = {k.removeprefix("base_model.model."): v for k, v in saved.items() if "vision_tower" in k}
    base_vision = {k: v for k, v in base.items() if k.startswith("model.vision_tower.")}
    assert saved_vision.keys() == base_vision.keys()
    unchanged = [k for k in base_vision if torch.equal(saved_vision[k], base_vision[k])]
    assert not unchanged, f"vision tower weights that did not train: {unchanged}"
    assert not any("lora_" in k for k in saved if "vision_tower" in k)

    # Plain transformers + PEFT load the adapter with the trained vision tower, and the keyword-only call reaches it.
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base_dir), out).eval()
    params = dict(reloaded.named_parameters())
    for key, value in saved_vision.items():
        name = key.replace("model.vision_tower.", "base_model.model.model.vision_tower.modules_to_save.default.", 1)
        torch.testing.assert_close(params[name], value, atol=0, rtol=0)
    from hellbender.models.fixes.gemma4 import load_processor

    pixels = load_processor(base_dir).image_processor([square("red", 4, 9)], return_tensors="pt")
    plain = AutoModelForImageTextToText.from_pretrained(base_dir).eval()

    def features(model):  # one tensor of soft-token features per image
        with torch.no_grad():
            return torch.cat(list(model.get_image_features(**pixels).pooler_output))

    before = features(plain.model)
    assert not plain.load_state_dict(saved_vision, strict=False).unexpected_keys
    expected = features(plain.model)
    got = features(reloaded.base_model.model.model)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, before, atol=1e-4)


# --- 3. default LoRA adapts only the language model -------------------------------------------------------------


@pytest.mark.parametrize(
    "name, target_linear",
    [(GEMMA4, False), (QWEN, False), (LLAVA, False), (IDEFICS3, False), (GEMMA4, True), (QWEN, True)],
)
def test_default_lora_on_a_vlm_adapts_only_the_language_model(tmp_path, name, target_linear):
    """Default targets (the attention and MLP projections), and with `lora_target_linear: true` every linear layer:
    only those of the language model get LoRA matrices, none of the vision tower or projector."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from hellbender.config.defaults import DEFAULT_LORA_TARGETS

    base_dir = model_dir(name)
    cfg = validate_config(vlm_config(tmp_path, name, adapter="lora", lora_target_linear=target_linear, max_steps=1))
    train(cfg)
    saved = load_file(Path(cfg.output_dir) / "adapter_model.safetensors")
    lm = LANGUAGE_MODEL[name]
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in saved if ".lora_" in k}
    base = AutoModelForImageTextToText.from_pretrained(base_dir)
    if target_linear:
        candidates = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and m is not base.lm_head}
    else:
        candidates = {n for n, _ in base.named_modules() if n.rsplit(".", 1)[-1] in DEFAULT_LORA_TARGETS}
    expected = {n for n in candidates if n.startswith(lm)}
    # The vision side has modules of the same kind (q_proj, gate_proj, linear layers), which must not be adapted.
    assert candidates - expected, "no vision module could be confused with a target; the test proves nothing"
    assert adapted == expected
    assert {k.split(".lora_")[1].split(".")[0] for k in saved if ".lora_" in k} == {"A", "B"}
    assert not [k for k in saved if any(part in k for part in VISION_PARTS)]


# --- 4. activation checkpointing and Gemma 4's shared K/V -------------------------------------------------------


def test_gemma4_gradients_with_and_without_activation_checkpointing_match():
    """hellbender's checkpointing (side channel on or off) reproduces every gradient exactly on Gemma 4 with shared
    K/V and an image in the batch; reentrant checkpointing does not (ARCHITECTURE.md principle 3), which is why
    hellbender never uses it."""
    from transformers import AutoModelForImageTextToText

    from hellbender.models.activation_checkpointing import enable_activation_checkpointing
    from hellbender.models.fixes.gemma4 import load_processor

    base_dir = model_dir(GEMMA4)
    processor = load_processor(base_dir)
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The square is red, a fine red square."}]},
    ]
    text = processor.apply_chat_template(chat, tokenize=False)
    batch = processor(text=[text, text], images=[[square("red", 3, 5)], [square("blue", 10, 2)]], return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[labels == processor.image_token_id] = -100
    assert batch["input_ids"].shape[1] > 2 * 16  # longer than the sliding window: shared K/V crosses layers

    def grads(checkpointing: str) -> dict[str, torch.Tensor]:
        model = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
        model.train()
        assert model.config.text_config.num_kv_shared_layers == 2
        if checkpointing == "reentrant":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()  # reentrant checkpointing needs inputs that require grad
        elif checkpointing != "none":
            enable_activation_checkpointing(model, side_channel=checkpointing == "side channel")
        model(**batch, labels=labels).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        return {n: p.grad for n, p in model.named_parameters()}

    plain = grads("none")
    for kind in ("side channel", "captured"):
        checkpointed = grads(kind)
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, atol=1e-7, rtol=1e-6, msg=f"{kind}: {name}")
    reentrant = grads("reentrant")
    worst = max((reentrant[n] - g).abs().max().item() for n, g in plain.items())
    assert worst > 1e-2, "reentrant checkpointing matched here; principle 3's claim is not shown by this model"


def test_gemma4_vlm_training_with_gradient_checkpointing_matches_training_without(tmp_path):
    common = dict(adapter="lora", lora_modules_to_save=["embed_vision"], max_steps=3, learning_rate=1e-2)
    plain = validate_config(vlm_config(tmp_path / "plain", GEMMA4, **common))
    checkpointed = validate_config(vlm_config(tmp_path / "ckpt", GEMMA4, gradient_checkpointing=True, **common))
    train(plain)
    train(checkpointed)
    expected, got = logged_losses(plain.output_dir), logged_losses(checkpointed.output_dir)
    assert sorted(got) == [1, 2, 3]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-5), (got, expected)
    a, b = final_weights(plain.output_dir), final_weights(checkpointed.output_dir)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-5)


# --- 5. freeze_mm_modules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [GEMMA4, QWEN])
def test_freeze_mm_modules_with_full_finetuning_trains_only_the_language_side(tmp_path, name):
    cfg = validate_config(vlm_config(tmp_path, name, freeze_mm_modules=True, max_steps=1, learning_rate=1e-3))
    snap = StepSnapshot()
    train(cfg, callbacks=[snap.callback])
    vision = [n for n in snap.before if any(part in n for part in VISION_PARTS)]
    language = [n for n in snap.before if n.startswith(LANGUAGE_MODEL[name])]
    assert vision and language and len(vision) + len(language) >= len(snap.before) - 1  # + an untied lm_head
    for n in vision:
        assert n not in snap.trainable, f"{n} is trainable"
        assert torch.equal(snap.before[n], snap.after[n]), f"frozen {n} changed"
    for n in language:
        assert n in snap.trainable, f"{n} is frozen"
        assert not torch.equal(snap.before[n], snap.after[n]), f"{n} did not change"


# --- 6. gradient accumulation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [GEMMA4, QWEN])
def test_vlm_gradient_accumulation_equals_the_larger_batch(tmp_path, name):
    """Two steps of micro-batch 4 == two steps of 2 x 2 accumulated micro-batches: the loss is averaged over the
    trained tokens of all accumulated micro-batches, not per micro-batch (rows have different numbers of trained
    tokens). Plain SGD, so the final weights differ exactly as the gradients do (Adam's first steps are about
    sign(gradient), which hides a wrongly weighted gradient and magnifies float noise in near-zero ones)."""
    common = dict(
        adapter="lora",
        lora_modules_to_save=["embed_vision"] if name == GEMMA4 else [],
        max_steps=2,
        optimizer="sgd",
        learning_rate=0.1,
    )
    big = validate_config(vlm_config(tmp_path / "big", name, micro_batch_size=4, **common))
    small = validate_config(
        vlm_config(tmp_path / "acc", name, micro_batch_size=2, gradient_accumulation_steps=2, **common)
    )
    train(big)
    train(small)
    big_losses, small_losses = logged_losses(big.output_dir), logged_losses(small.output_dir)
    for step in (1, 2):
        assert small_losses[step] == pytest.approx(big_losses[step], rel=1e-6), (big_losses, small_losses)
    a, b = final_weights(big.output_dir), final_weights(small.output_dir)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-5, msg=key)


# --- 7. rows without images ------------------------------------------------------------------------------------------


class BatchRecorder:
    """Wraps the collator hellbender builds, recording what each batch held (rows with images, pixel values)."""

    def __init__(self, monkeypatch):
        import hellbender.data.batching as batching

        self.batches: list[dict] = []
        original = batching.MultimodalCollator
        outer = self

        class Recording(original):
            def __call__(self, rows):
                batch = super().__call__(rows)
                outer.batches.append(
                    {
                        "with_images": sum(bool(r["images"]) for r in rows),
                        "rows": len(rows),
                        "pixel_values": "pixel_values" in batch,
                    }
                )
                return batch

        monkeypatch.setattr(batching, "MultimodalCollator", Recording)


def test_gemma4_vlm_trains_on_text_only_chat_rows(tmp_path, monkeypatch):
    rows = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()][:64]
    assert all(isinstance(m["content"], str) for r in rows for m in r["messages"])
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    recorder = BatchRecorder(monkeypatch)
    cfg = validate_config(
        vlm_config(
            tmp_path,
            GEMMA4,
            datasets=[{"path": str(data), "type": "chat_template"}],
            adapter="lora",
            lora_target_linear=True,
            lora_modules_to_save=["embed_tokens", "lm_head"],
            max_steps=10,
            learning_rate=1e-2,
        )
    )
    metrics = train(cfg)
    losses = logged_losses(cfg.output_dir)
    assert sorted(losses) == list(range(1, 11))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (8, 9, 10)) / 3
    assert last < 0.8 * first, losses
    assert metrics["trained_tokens"] > 0
    assert len(recorder.batches) >= 10  # the data loader may collate one batch ahead
    assert all(b["with_images"] == 0 and not b["pixel_values"] for b in recorder.batches)


def test_gemma4_vlm_trains_on_batches_mixing_image_and_text_only_rows(tmp_path, monkeypatch):
    """Every batch holds two rows with an image and two without (4 rows, micro-batch 4)."""
    shapes = [json.loads(line) for line in SHAPES_DATA.read_text().splitlines()][:2]
    chats = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()][:2]
    assert all(len(r["messages"][0]["content"]) == 2 for r in shapes)  # one image part + the question
    data = write_jsonl(tmp_path / "mixed.jsonl", [shapes[0], chats[0], shapes[1], chats[1]])
    recorder = BatchRecorder(monkeypatch)
    cfg = validate_config(
        vlm_config(
            tmp_path,
            GEMMA4,
            datasets=[{"path": str(data), "type": "chat_template", "image_base_dir": str(SHAPES_DATA.parent)}],
            adapter="lora",
            max_steps=3,
            learning_rate=3e-3,
        )
    )
    train(cfg)
    assert sorted(logged_losses(cfg.output_dir)) == [1, 2, 3]
    assert all(math.isfinite(v) for v in logged_losses(cfg.output_dir).values())
    assert len(recorder.batches) >= 3  # the data loader may collate one batch ahead
    assert all(b == {"with_images": 2, "rows": 4, "pixel_values": True} for b in recorder.batches)


# --- 8. exact resume ------------------------------------------------------------------------------------------------


def test_gemma4_vlm_resumed_run_reproduces_the_uninterrupted_run(tmp_path):
    half = 3
    common = dict(
        adapter="lora",
        lora_dropout=0.1,  # dropout exercises the restored RNG state
        lora_modules_to_save=["embed_vision"],
        max_steps=2 * half,
        save_steps=half,
        lr_scheduler="cosine",
        warmup_steps=2,
        learning_rate=3e-3,
    )
    reference = validate_config(vlm_config(tmp_path / "ref", GEMMA4, **common))
    train(reference)
    expected = logged_losses(reference.output_dir)

    cfg = validate_config(vlm_config(tmp_path / "resumed", GEMMA4, auto_resume_from_checkpoints=True, **common))
    train(cfg, callbacks=[StopAt(half)])
    assert (Path(cfg.output_dir) / f"checkpoint-{half}").is_dir()
    assert sorted(logged_losses(cfg.output_dir)) == list(range(1, half + 1))
    train(cfg)  # resumes from checkpoint-3
    got = logged_losses(cfg.output_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 2 * half + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
    state = json.loads((Path(cfg.output_dir) / "trainer_state.json").read_text())
    ref_state = json.loads((Path(reference.output_dir) / "trainer_state.json").read_text())
    counters = state["stateful_callbacks"]["TokenCounter"]["attributes"]
    assert counters == ref_state["stateful_callbacks"]["TokenCounter"]["attributes"]
    final, ref_final = final_weights(cfg.output_dir), final_weights(reference.output_dir)
    assert final.keys() == ref_final.keys()
    for key in final:
        torch.testing.assert_close(final[key], ref_final[key], atol=1e-6, rtol=1e-6)


# --- the first run that builds a tiny model ---------------------------------------------------------------------------


def test_first_run_of_a_tiny_model_trains_like_every_later_run(tmp_path, monkeypatch):
    """The same config and seed give the same training whether `train` had to build the tiny model first or found it
    built. A builder seeds and draws from torch's global RNG, and `train` seeds before it loads the tokenizer (which
    builds the model), so `tiny_model_dir` must keep the build away from the caller's RNG; otherwise the first run's
    LoRA matrices start elsewhere and a test's result depends on which test happened to build the model."""
    monkeypatch.setenv("HELLBENDER_CACHE", str(tmp_path / "fresh-cache"))
    common = dict(adapter="lora", max_steps=2, learning_rate=1e-2)
    first = validate_config(vlm_config(tmp_path / "first", QWEN, **common))
    train(first)  # builds hellbender/tiny-qwen2.5-vl into the empty cache
    again = validate_config(vlm_config(tmp_path / "again", QWEN, **common))
    train(again)
    a, b = final_weights(first.output_dir), final_weights(again.output_dir)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=0, rtol=0, msg=key)
