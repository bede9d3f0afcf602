"""DPO on pairs whose prompts hold images, for the tiny Gemma 4, Qwen2.5-VL, LLaVA and Idefics3: the prepared ids (the prompt holds the
image tokens, the answers continue it exactly), the collated batch (the vision inputs for the chosen and the rejected
half), the first step (policy equals reference), a short run that saves a loadable adapter, and the image sandbox."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hellbender.config.loading import validate_config
from hellbender.errors import ConfigError, DataError
from tests.conftest import EXAMPLES, write_jsonl
from tests.helpers import vlm_config
from tests.tiny_vlms import GEMMA4, IDEFICS3, LLAVA, QWEN, TINY_VLMS

FAMILIES = {
    GEMMA4: TINY_VLMS["gemma4"],
    QWEN: TINY_VLMS["qwen2.5-vl"],
    LLAVA: TINY_VLMS["llava"],
    IDEFICS3: TINY_VLMS["idefics3"],
}
IMAGES = EXAMPLES / "data"  # the bundled coloured squares: shapes/000.png ...
QUESTION = "What colour is the square?"


def pair_rows(count: int, image: str = "shapes/{i:03d}.png") -> list[dict]:
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "path": image.format(i=i)}, {"type": "text", "text": QUESTION}],
                }
            ],
            "chosen": {"role": "assistant", "content": "The square is red."},
            "rejected": {"role": "assistant", "content": [{"type": "text", "text": "It is a circle."}]},
        }
        for i in range(count)
    ]


def dpo_vlm_config(tmp_path: Path, model: str, rows: list[dict] | None = None, **overrides):
    data = write_jsonl(tmp_path / "pairs.jsonl", rows if rows is not None else pair_rows(8))
    settings = dict(
        rl="dpo",
        adapter="lora",
        lora_r=8,
        lora_alpha=16,
        micro_batch_size=4,
        max_steps=2,
        datasets=[{"path": str(data), "type": "chat_template.default", "image_base_dir": str(IMAGES)}],
    )
    return validate_config(vlm_config(tmp_path, model, **{**settings, **overrides}))


def prepared(cfg):
    from hellbender.data.prepare import prepare_datasets
    from hellbender.models.loading import load_tokenizer_and_processor

    tokenizer, processor = load_tokenizer_and_processor(cfg)
    return tokenizer, processor, prepare_datasets(cfg, tokenizer, processor).train


def square(index: int):
    from PIL import Image

    with Image.open(IMAGES / "shapes" / f"{index:03d}.png") as img:
        return img.convert("RGB")


@pytest.mark.parametrize("model", FAMILIES)
def test_prompt_holds_the_image_tokens_and_the_answers_continue_it(tmp_path, model):
    spec = FAMILIES[model]
    tokenizer, processor, rows = prepared(dpo_vlm_config(tmp_path, model))
    row = rows[0]
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    prompt_text = processor.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
    index = int(Path(row["prompt_images"][0]).stem)  # the rows are shuffled
    assert row["prompt_text"] == prompt_text
    assert row["prompt_images"] == [str((IMAGES / f"shapes/{index:03d}.png").resolve())]
    # The processor's own expansion of the prompt with its image: exactly the prepared prompt.
    expected = processor(text=[prompt_text], images=[[square(index)]], add_special_tokens=False)["input_ids"][0]
    assert row["prompt_ids"] == list(expected)
    image_token = tokenizer.convert_tokens_to_ids(spec.label_masked_tokens[0])
    assert row["prompt_ids"].count(image_token) == spec.tokens_per_image
    for name, answer in (("chosen", "The square is red."), ("rejected", "It is a circle.")):
        conversation = [question, {"role": "assistant", "content": answer}]
        full = processor.apply_chat_template(conversation, tokenize=False).rstrip()
        full_ids = processor(text=[full], images=[[square(index)]], add_special_tokens=False)["input_ids"][0]
        assert row["prompt_ids"] + row[f"{name}_ids"] == list(full_ids)  # the answer continues the prompt exactly
        assert tokenizer.decode(row[f"{name}_ids"]).lstrip().startswith(answer)  # LLaVA: "ASSISTANT: The ..."
        assert image_token not in row[f"{name}_ids"]
    # TRL switches to its own vision path (raw text at batch time) when a column is named `image` or `images`.
    assert not {"image", "images"} & set(rows.column_names)


@pytest.mark.parametrize("model", FAMILIES)
def test_the_batch_holds_the_images_for_the_chosen_and_the_rejected_half(tmp_path, model):
    from hellbender.data.preference_collator import preference_collator

    spec = FAMILIES[model]
    cfg = dpo_vlm_config(tmp_path, model)
    tokenizer, processor, rows = prepared(cfg)
    pairs = [rows[i] for i in range(3)]
    batch = preference_collator(cfg, tokenizer, processor)(pairs)
    for i, pair in enumerate(pairs):  # chosen rows first, then rejected rows, as TRL's DataCollatorForPreference
        for half, name in enumerate(("chosen", "rejected")):
            r = half * len(pairs) + i
            ids = pair["prompt_ids"] + pair[f"{name}_ids"]
            assert batch["input_ids"][r, : len(ids)].tolist() == ids
            assert batch["attention_mask"][r].sum() == len(ids)
            assert batch["completion_mask"][r].tolist() == [0] * len(pair["prompt_ids"]) + [1] * len(
                pair[f"{name}_ids"]
            ) + [0] * (batch["input_ids"].shape[1] - len(ids))
    # Each row's image tokens are the prompt's, in both halves; the answers are text.
    image_token = tokenizer.convert_tokens_to_ids(spec.label_masked_tokens[0])
    assert (batch["input_ids"] == image_token).sum(dim=1).tolist() == [spec.tokens_per_image] * 6
    pixels = batch["pixel_values"]
    half = pixels.shape[0] // 2
    assert torch.equal(pixels[:half], pixels[half:])
    if model == QWEN:
        assert batch["image_grid_thw"].shape == (6, 3)
        assert half == 3 * int(batch["image_grid_thw"][0].prod())
    elif model == GEMMA4:
        assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [spec.tokens_per_image] * 6
        assert pixels.shape[0] == 6 and batch["image_position_ids"].shape[0] == 6
    elif model == IDEFICS3:  # one image per row, split into tiles and a global view
        assert pixels.shape[:2] == (6, 5) and batch["pixel_attention_mask"].shape[:2] == (6, 5)
    else:
        assert pixels.shape[0] == 6


def dpo_trainer(cfg, rows, processor, tokenizer):
    """The trainer `hellbender train` builds for a DPO config with a processor, on the given prepared pairs."""
    from hellbender.data.preference_collator import preference_collator
    from hellbender.models.stack import build_trainable_model
    from hellbender.train.arguments import training_arguments
    from hellbender.train.methods import preference_method
    from hellbender.train.schedule import plan_schedule
    from hellbender.train.tokens import TokenCounter

    method = preference_method(cfg)
    model = build_trainable_model(cfg, tokenizer)
    args = training_arguments(cfg, plan_schedule(cfg, len(rows), 1), False, False, *method.arguments(cfg))
    collator = preference_collator(cfg, tokenizer, processor)
    return method.build_trainer(
        cfg, model, args, rows, None, processor, data_collator=collator, callbacks=[TokenCounter()]
    )


@pytest.mark.parametrize("model", FAMILIES)
def test_first_step_loss_is_log_2_and_the_images_reach_both_passes(tmp_path, model):
    cfg = dpo_vlm_config(tmp_path, model)
    tokenizer, processor, rows = prepared(cfg)
    trainer = dpo_trainer(cfg, rows, processor, tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    # Policy and reference saw the same tokens and the same pixels: the rewards are exactly 0.
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["rewards/chosen"] == 0.0 and metrics["rewards/rejected"] == 0.0
    # The pixels are read: other pixels give the answers other log-probabilities (policy and reference alike).
    ref_chosen, _ = trainer.compute_ref_log_probs(trainer.model, batch)
    # Not zeros: Idefics3 drops an all-zero image as padding.
    blank = {**batch, "pixel_values": torch.full_like(batch["pixel_values"], 0.5)}
    blank_chosen, _ = trainer.compute_ref_log_probs(trainer.model, blank)
    assert not torch.allclose(ref_chosen, blank_chosen)


@pytest.mark.parametrize("model", FAMILIES)
def test_a_short_run_saves_a_loadable_adapter(tmp_path, model):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from hellbender.models.tiny import tiny_model_dir
    from hellbender.train.run import train
    from hellbender.use.evaluate import evaluate
    from tests.helpers import logged_losses, trainer_state

    cfg = dpo_vlm_config(
        tmp_path, model, rows=pair_rows(10), max_steps=3, learning_rate=1e-2, val_set_size=2, eval_steps=3
    )
    metrics = train(cfg)
    assert metrics["trained_tokens"] > 0
    losses = logged_losses(cfg.output_dir)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    # `hellbender evaluate` scores the held-out pairs with their images, as the run's last evaluation did.
    scores = evaluate(cfg)
    last = [entry for entry in trainer_state(cfg.output_dir)["log_history"] if "eval_loss" in entry][-1]
    assert last["step"] == 3 and scores["pairs"] == 2
    assert scores["loss"] == pytest.approx(last["eval_loss"], abs=1e-5)
    assert scores["mean_margin"] == pytest.approx(last["eval_rewards/margins"], abs=1e-5)
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(model), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, cfg.output_dir)
    trained = [p for name, p in adapted.named_parameters() if "lora_B" in name]
    assert trained and any(p.abs().sum() > 0 for p in trained)  # lora_B starts at zero: the adapter learnt


def test_an_image_outside_image_base_dir_is_refused_by_name(tmp_path):
    outside = tmp_path / "elsewhere" / "secret.png"
    outside.parent.mkdir()
    square(0).save(outside)
    rows = pair_rows(2)
    rows[1]["messages"][0]["content"][0]["path"] = str(outside)
    cfg = dpo_vlm_config(tmp_path, QWEN, rows=rows)
    with pytest.raises(DataError) as error:
        prepared(cfg)
    assert "row 1" in str(error.value) and "secret.png" in str(error.value)


def test_a_changed_processor_is_refused_at_batch_time(tmp_path):
    from hellbender.data.preference_collator import preference_collator

    cfg = dpo_vlm_config(tmp_path, QWEN)
    tokenizer, processor, rows = prepared(cfg)
    image_processor = processor.image_processor
    image_processor.size = {"shortest_edge": image_processor.size["shortest_edge"], "longest_edge": 1024}  # more tokens
    with pytest.raises(DataError, match="differently"):
        preference_collator(cfg, tokenizer, processor)([rows[0]])


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"rl": "kto"}, ["rl: kto", "processor_type"]),
        ({"precompute_ref_log_probs": True, "adapter": None}, ["precompute_ref_log_probs", "processor_type"]),
        ({"dpo_shared_prompt": True}, ["dpo_shared_prompt: true", "processor_type", "images belong to its prompt"]),
        ({"type": "chatml.intel"}, ["datasets[0]", "chatml.intel", "chat_template.default"]),
    ],
)
def test_what_vision_preference_tuning_cannot_do_is_refused_by_name(tmp_path, overrides, needles):
    kind = overrides.pop("type", "chat_template.default")
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(2))
    with pytest.raises(ConfigError) as error:
        dpo_vlm_config(tmp_path, QWEN, datasets=[{"path": str(data), "type": kind}], **overrides)
    for needle in needles:
        assert needle in str(error.value)


def test_argilla_chat_rows_and_an_image_column_give_the_same_pairs(tmp_path):
    rows = pair_rows(2)
    user = rows[0]["messages"][0]
    argilla = [
        {
            "chosen": [user, {"role": "assistant", "content": "The square is red."}],
            "rejected": [user, {"role": "assistant", "content": "It is a circle."}],
        }
        for _ in range(2)
    ]
    column = [
        {
            "messages": [{"role": "user", "content": QUESTION}],
            "images": ["shapes/000.png"],
            "chosen": "The square is red.",
            "rejected": "It is a circle.",
        }
        for _ in range(2)
    ]
    prepared_pairs = {}
    for name, kind, data in (
        ("default", "chat_template.default", [rows[0], rows[0]]),
        ("argilla", "chat_template.argilla_chat", argilla),
        ("column", "chat_template.default", column),
    ):
        path = write_jsonl(tmp_path / f"{name}.jsonl", data)
        cfg = dpo_vlm_config(
            tmp_path / name, QWEN, datasets=[{"path": str(path), "type": kind, "image_base_dir": str(IMAGES)}]
        )
        row = prepared(cfg)[2][0]
        prepared_pairs[name] = {key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids", "prompt_images")}
    assert prepared_pairs["argilla"] == prepared_pairs["default"] == prepared_pairs["column"]
    assert prepared_pairs["default"]["prompt_images"] == [str((IMAGES / "shapes/000.png").resolve())]


def test_an_answer_with_an_image_is_refused_by_name(tmp_path):
    rows = pair_rows(2)
    rows[1]["chosen"] = {"role": "assistant", "content": [{"type": "image", "path": "shapes/001.png"}]}
    with pytest.raises(DataError) as error:
        prepared(dpo_vlm_config(tmp_path, QWEN, rows=rows))
    assert "row 1" in str(error.value) and "chosen answer" in str(error.value) and "holds an image" in str(error.value)
