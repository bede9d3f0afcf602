"""Preference data: each dataset type's exact prompt / chosen / rejected tokens (and KTO's completion and label),
chosen and rejected sharing the prompt's ids, long rows, bad rows, and the prepared-data cache."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from hellbender.config import DatasetEntry, validate_config
from hellbender.data.formats.base import DROP_TOO_LONG
from hellbender.data.formats.preference_rows import read_preference_row
from hellbender.data.preference import (
    DROP_PROMPT_TOO_LONG,
    Limits,
    encode_preference_row,
    preference_context,
    tokenize_preference_dataset,
)
from hellbender.data.prepare import prepare_datasets
from hellbender.errors import ConfigError, DataError
from tests.conftest import write_config, write_jsonl
from tests.helpers import assert_user_error, invoke

pytestmark = pytest.mark.usefixtures("libraries_log_to_the_session_stderr")

LLAMA3_MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
EOS = "<|endoftext|>"  # the tiny tokenizer's EOS; it has no BOS


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer (ChatML template) with Llama 3's markers as special tokens too."""
    from hellbender.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(extra_special_tokens=LLAMA3_MARKERS)


def chatml(*turns: tuple[str, str]) -> str:
    """The ChatML prompt of `turns`, ending with the assistant's opening."""
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + "<|im_start|>assistant\n"


def llama3(*turns: tuple[str, str]) -> str:
    head = "".join(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>" for role, text in turns)
    return head + "<|start_header_id|>assistant<|end_header_id|>\n\n"


SYS, USER = ("system", "Be brief."), ("user", "Name a colour.")


def conversation(answer: str) -> list[dict]:
    return [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": answer}]


# (type, entry keys, row, expected prompt text, expected answer texts) of paired rows.
FAMILY_ROWS = {  # variant -> (row, turns of the prompt); answers `Blue.` / `Seven.`
    "default": ({"system": "Be brief.", "instruction": "Name a colour.", "chosen_response": "Blue.",
                 "rejected_response": "Seven."}, (SYS, USER)),
    "argilla": ({"instruction": "Name a colour.", "chosen_response": "Blue.", "rejected_response": "Seven."}, (USER,)),
    "argilla_chat": ({"chosen": conversation("Blue."), "rejected": conversation("Seven.")}, (USER,)),
    "icr": ({"system": "Be brief.", "input": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}, (SYS, USER)),
    "intel": ({"system": "", "question": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}, (USER,)),
    "prompt_pairs": ({"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}, (USER,)),
    "ultra": ({"system": "Be brief.", "prompt": "Name a colour.", "chosen": conversation("Blue."),
               "rejected": conversation("Seven.")}, (SYS, USER)),
}  # fmt: skip
FAMILY_END = {"chatml": ("<|im_end|>", chatml), "llama3": ("<|eot_id|>", llama3)}

PAIRED_CASES = [
    (
        f"{family}.{variant}",
        {},
        row,
        render(*turns),
        {"chosen": f"Blue.{end}{EOS}", "rejected": f"Seven.{end}{EOS}"},
    )
    for family, (end, render) in FAMILY_END.items()
    for variant, (row, turns) in FAMILY_ROWS.items()
] + [
    ("chatml", {}, FAMILY_ROWS["default"][0], chatml(SYS, USER), {"chosen": f"Blue.<|im_end|>{EOS}",
                                                                   "rejected": f"Seven.<|im_end|>{EOS}"}),
    (
        "chat_template.default",
        {},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
         "chosen": {"role": "assistant", "content": "Blue."}, "rejected": {"role": "assistant", "content": "Seven."}},
        chatml(SYS, USER),
        {"chosen": "Blue.<|im_end|>", "rejected": "Seven.<|im_end|>"},
    ),
    (
        "chat_template.default",
        {"field_messages": "dialogue", "field_chosen": "better", "field_rejected": "worse",
         "message_property_mappings": {"role": "from", "content": "value"}, "roles": {"user": ["human"]}},
        {"dialogue": [{"from": "human", "value": "Name a colour."}], "better": "Blue.",
         "worse": [{"from": "human", "value": "Name a colour."}, {"from": "assistant", "value": "Seven."}]},
        chatml(USER),
        {"chosen": "Blue.<|im_end|>", "rejected": "Seven.<|im_end|>"},
    ),
    (
        "chat_template.argilla_chat",
        {},
        {"chosen": conversation("Blue."), "rejected": conversation("Seven.")},
        chatml(USER),
        {"chosen": "Blue.<|im_end|>", "rejected": "Seven.<|im_end|>"},
    ),
    (
        "chat_template.argilla",
        {},
        {"system": "Be brief.", "prompt": "Name a colour.", "chosen": conversation("Blue."),
         "rejected": conversation("Seven.")},
        chatml(SYS, USER),
        {"chosen": "Blue.<|im_end|>", "rejected": "Seven.<|im_end|>"},
    ),
    (
        "bradley_terry.chat_template",
        {},
        {"system": "Be brief.", "input": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."},
        chatml(SYS, USER),
        {"chosen": "Blue.<|im_end|>", "rejected": "Seven.<|im_end|>"},
    ),
    (
        "zephyr.nectar",
        {},
        {"prompt": "Name a colour.", "answers": [{"answer": "Seven.", "rank": 2}, {"answer": "Green?", "rank": 3},
                                                 {"answer": "Blue.", "rank": 1}]},
        "<|system|>\n</s>\n<|user|>\nName a colour.</s>\n<|assistant|>\n",
        {"chosen": f"Blue.{EOS}", "rejected": f"Seven.{EOS}"},
    ),
    (
        {"field_prompt": "q", "field_system": "sys", "field_chosen": "good", "field_rejected": "bad",
         "prompt_format": "[{system}] Q: {prompt}\nA:\n", "chosen_format": "{chosen}!", "rejected_format": "{rejected}?"},
        None,
        {"sys": "Be brief.", "q": "Name a colour.", "good": "Blue.", "bad": "Seven."},
        "[Be brief.] Q: Name a colour.\nA:\n",
        {"chosen": f"Blue.!{EOS}", "rejected": f"Seven.?{EOS}"},
    ),
]  # fmt: skip

KTO_FAMILY_ROWS = {  # variant -> (row, prompt turns); the answer is `Blue.`
    "argilla": ({"system": "Be brief.", "instruction": "Name a colour.", "completion": "Blue.", "label": True},
                (SYS, USER)),
    "argilla_chat": ({"completion": conversation("Blue."), "label": False}, (USER,)),
    "intel": ({"question": "Name a colour.", "completion": "Blue.", "label": True}, (USER,)),
    "prompt_pairs": ({"prompt": "Name a colour.", "completion": "Blue.", "label": False}, (USER,)),
    "ultra": ({"system": "Be brief.", "prompt": "Name a colour.", "completion": "Blue.", "label": True}, (SYS, USER)),
}  # fmt: skip
KTO_CASES = [
    (f"{family}.{variant}", row, render(*turns), f"Blue.{end}{EOS}", row["label"])
    for family, (end, render) in FAMILY_END.items()
    for variant, (row, turns) in KTO_FAMILY_ROWS.items()
] + [
    (
        {"field_prompt": "q", "field_completion": "a", "field_label": "ok", "prompt_format": "Q: {prompt}\nA: ",
         "completion_format": "{completion}."},
        {"q": "Name a colour", "a": "Blue", "ok": False},
        "Q: Name a colour\nA: ",
        f"Blue.{EOS}",
        False,
    )
]  # fmt: skip


def run_cfg(rl: str | None = None, **keys):
    """What the preference data reads of the config (the run's `rl` is the trainer's key)."""
    return types.SimpleNamespace(chat_template=None, chat_template_jinja=None, rl=rl, **keys)


def entry(kind, keys: dict) -> DatasetEntry:
    if isinstance(kind, dict):  # Axolotl's `type:` mapping of `user_defined.default`
        return DatasetEntry(path="rows.jsonl", type=kind)
    return DatasetEntry(path="rows.jsonl", type=kind, **keys)


def encode(tok, e: DatasetEntry, row: dict, rl: str | None = None, limits: Limits | None = None) -> dict:
    ctx = preference_context(e, run_cfg(rl), tok)
    return encode_preference_row(row, 7, ctx, limits or Limits(4096, None, "raise", 1), "Dataset `rows.jsonl`")


def ids(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize(("kind", "keys", "row", "prompt", "answers"), PAIRED_CASES, ids=lambda v: str(v)[:40])
def test_each_paired_type_gives_the_exact_prompt_and_answer_tokens(tok, kind, keys, row, prompt, answers):
    e = entry(kind, keys or {})
    out = encode(tok, e, row)
    assert out["drop_reason"] == ""
    assert tok.decode(out["prompt_ids"]) == prompt
    for name, text in answers.items():
        assert tok.decode(out[f"{name}_ids"]) == text
        # Chosen and rejected continue the one prompt: prompt + answer is the whole rendering's tokens.
        assert out["prompt_ids"] + out[f"{name}_ids"] == ids(tok, prompt + text, special=True)
    assert out["chosen_ids"] != out["rejected_ids"]
    texts = read_preference_row(row, preference_context(e, run_cfg(), tok))
    assert texts.prompt == prompt and texts.full == {name: prompt + text for name, text in answers.items()}


@pytest.mark.parametrize(("kind", "row", "prompt", "completion", "label"), KTO_CASES, ids=lambda v: str(v)[:40])
def test_each_kto_type_gives_the_exact_prompt_completion_and_label(tok, kind, row, prompt, completion, label):
    out = encode(tok, entry(kind, {}), row, rl="kto")
    assert set(out) == {"prompt_ids", "completion_ids", "label", "drop_reason"}
    assert tok.decode(out["prompt_ids"]) == prompt
    assert tok.decode(out["completion_ids"]) == completion
    assert out["prompt_ids"] + out["completion_ids"] == ids(tok, prompt + completion, special=True)
    assert out["label"] is label


def test_the_exact_ids_of_a_chat_template_pair_and_the_positions_trl_trains(tok):
    """Literal ids (the tiny tokenizer is fixed in the repository), and TRL's collator trains exactly the answers."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    row = {"messages": [{"role": "user", "content": "Q0"}], "chosen": "Good.", "rejected": "Bad."}
    out = encode(tok, entry("chat_template.default", {}), row)
    assert out["prompt_ids"] == [2, 280, 273, 202, 52, 19, 3, 202, 2, 278, 372, 202]
    assert out["chosen_ids"] == [42, 82, 82, 71, 17, 3]
    assert out["rejected_ids"] == [37, 309, 17, 3]
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([out])
    n = len(out["prompt_ids"])
    assert batch["input_ids"][0, :n].tolist() == out["prompt_ids"] == batch["input_ids"][1, :n].tolist()
    assert batch["completion_mask"][0].tolist() == [0] * n + [1] * 6
    assert batch["completion_mask"][1].tolist() == [0] * n + [1] * 4 + [0] * 2  # padding is not trained


def test_the_named_chat_template_renders_chat_template_rows(tok):
    from hellbender.chat_templates import NAMED_TEMPLATES

    name = "llama3"
    assert name in NAMED_TEMPLATES
    e = DatasetEntry(path="rows.jsonl", type="chat_template.argilla_chat", chat_template=name)
    tok3 = _llama3_tokenizer()
    out = encode(tok3, e, {"chosen": conversation("Blue."), "rejected": conversation("Seven.")})
    prompt = tok3.decode(out["prompt_ids"])
    assert prompt.endswith(llama3(USER)) and "<|im_start|>" not in prompt
    assert tok3.decode(out["chosen_ids"]) == "Blue.<|eot_id|>"


def _llama3_tokenizer():
    from hellbender.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(extra_special_tokens=[*LLAMA3_MARKERS, "<|begin_of_text|>"])


# --- long rows ------------------------------------------------------------------------------------------------

LONG = {"prompt": "Name a colour.", "chosen": "Blue is the colour of the sky on a clear day.", "rejected": "Seven."}


def test_truncate_cuts_the_answers_to_sequence_len_after_the_whole_prompt(tok):
    e = entry("chatml.prompt_pairs", {})
    full = encode(tok, e, LONG)
    room = len(full["rejected_ids"])
    assert len(full["chosen_ids"]) > room
    limit = len(full["prompt_ids"]) + room
    out = encode(tok, e, LONG, limits=Limits(limit, None, "truncate", 1))
    assert out["drop_reason"] == "" and out["prompt_ids"] == full["prompt_ids"]
    assert out["chosen_ids"] == full["chosen_ids"][:room]
    assert out["rejected_ids"] == full["rejected_ids"]  # already fits
    assert encode(tok, e, LONG, limits=Limits(limit, None, "drop", 1))["drop_reason"] == DROP_TOO_LONG
    # A prompt that fills sequence_len leaves no answer: dropped even under truncate.
    short = Limits(len(full["prompt_ids"]), None, "truncate", 1)
    assert encode(tok, e, LONG, limits=short)["drop_reason"] == DROP_TOO_LONG
    with pytest.raises(DataError, match=r"row 7: its prompt and chosen answer are \d+ tokens"):
        encode(tok, e, LONG, limits=Limits(limit, None, "raise", 1))


def test_max_prompt_len_keeps_the_prompts_end_or_drops_the_row(tok):
    e = entry("chatml.prompt_pairs", {})
    full = encode(tok, e, LONG)
    out = encode(tok, e, LONG, limits=Limits(4096, 5, "truncate", 1))
    assert out["prompt_ids"] == full["prompt_ids"][-5:]  # the end, next to the answer
    assert out["chosen_ids"] == full["chosen_ids"]
    assert encode(tok, e, LONG, limits=Limits(4096, 5, "drop", 1))["drop_reason"] == DROP_PROMPT_TOO_LONG
    with pytest.raises(DataError, match="more than `max_prompt_len: 5`"):
        encode(tok, e, LONG, limits=Limits(4096, 5, "raise", 1))


def test_dropped_rows_are_counted_per_reason(tok):
    import datasets

    rows = [LONG, {**LONG, "chosen": "Blue."}, {**LONG, "prompt": "Name a colour " * 20}]
    ctx = preference_context(entry("chatml.prompt_pairs", {}), run_cfg(), tok)
    kept, stats = tokenize_preference_dataset(
        datasets.Dataset.from_list(rows), ctx, Limits(40, 30, "drop", 1), "Dataset `rows.jsonl`", None
    )
    assert stats.rows_in == 3 and stats.rows_kept == 1
    assert dict(stats.dropped) == {DROP_TOO_LONG: 1, DROP_PROMPT_TOO_LONG: 1}
    row = kept[0]
    assert stats.trainable_tokens == len(row["chosen_ids"]) + len(row["rejected_ids"])
    assert stats.tokens == 2 * len(row["prompt_ids"]) + stats.trainable_tokens


# --- bad rows and templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "row", "rl", "needles"),
    [
        ("chatml.intel", {"question": "Q", "rejected": "No."}, None, ["no chosen answer: column `chosen` is missing"]),
        ("chatml.intel", {"question": "Q", "chosen": "Yes.", "rejected": " "}, None, ["rejected answer", "empty"]),
        ("chat_template.default", {"messages": [{"role": "user", "content": "Q"}], "chosen": "A",
                                   "rejected": {"role": "assistant", "content": ""}}, None, ["rejected", "empty"]),
        ("chat_template.argilla_chat", {"chosen": conversation("A"), "rejected": [
            {"role": "user", "content": "Another question"}, {"role": "assistant", "content": "B"}]}, None,
         ["differ before their answers", "message 0"]),
        ("chatml.argilla_chat", {"chosen": conversation("A"), "rejected": [
            {"role": "system", "content": "x"}, *conversation("B")]}, None, ["differ before their answers"]),
        ("chatml.intel", {"question": "Q", "completion": "A"}, "kto", ["KTO label", "missing"]),
        ("chatml.intel", {"question": "Q", "completion": "A", "label": "yes"}, "kto", ["'yes'", "`true`"]),
        ("chatml.intel", {"question": "Q", "completion": "A", "label": 1}, "kto", ["KTO label", "is 1"]),
        ("zephyr.nectar", {"prompt": "Q", "answers": [{"answer": "A", "rank": 1}]}, None, ["at least two"]),
    ],
    ids=lambda v: str(v)[:30],
)  # fmt: skip
def test_bad_rows_name_the_dataset_and_row(tok, kind, row, rl, needles):
    with pytest.raises(DataError) as err:
        encode(tok, entry(kind, {}), row, rl=rl)
    message = str(err.value)
    assert message.startswith("Dataset `rows.jsonl`, row 7: ")
    for needle in needles:
        assert needle in message


def test_a_template_that_renders_the_prompt_differently_before_an_answer_is_refused(tok):
    # A template that writes a system turn only when it is asked for a generation prompt.
    template = (
        "{% if add_generation_prompt %}<|im_start|>system\nHelp.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    e = DatasetEntry(path="rows.jsonl", type="chat_template.argilla_chat", chat_template="jinja",
                     chat_template_jinja=template)  # fmt: skip
    with pytest.raises(DataError, match="row 7: the chosen conversation does not start with the prompt"):
        encode(tok, e, {"chosen": conversation("A"), "rejected": conversation("B")})


def test_answers_whose_tokens_merge_with_the_prompt_are_refused(tok):
    # A prompt ending with a space: byte-level BPE joins the space to the answer's first word.
    e = entry({"prompt_format": "Q: {prompt}\nA: "}, {})
    with pytest.raises(DataError, match="row 7: the chosen answer's first tokens merge with the prompt") as err:
        encode(tok, e, {"prompt": "Name a colour.", "chosen": "Seven.", "rejected": "Blue."})
    assert "not a space" in str(err.value)


def test_family_markers_must_be_tokens_of_the_tokenizer(tiny_tokenizer):
    with pytest.raises(ConfigError, match="`type: llama3.intel` writes the marker tokens `<|start_header_id|>`"):
        preference_context(entry("llama3.intel", {}), run_cfg(), tiny_tokenizer)


# --- config ---------------------------------------------------------------------------------------------------


def pref_config(tmp_path: Path, data: Path, entry_keys: dict | None = None, **top) -> dict:
    return {
        "base_model": "hellbender/tiny-llama",
        "rl": "dpo",
        "datasets": [{"path": str(data), "type": "chat_template.default", **(entry_keys or {})}],
        "dataset_prepared_path": str(tmp_path / "prepared"),
        "output_dir": str(tmp_path / "out"),
        "sequence_len": 64,
        **top,
    }


def pair_rows(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"Question {i}?"}], "chosen": f"Yes {i}.", "rejected": "No."}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("top", "entry_keys", "needle"),
    [
        ({"sample_packing": True}, {}, "`sample_packing` cannot be used with `rl: dpo`"),
        ({"train_on_inputs": True}, {}, "`train_on_inputs: true` asks to train the prompt"),
        ({"group_by_length": True}, {}, "`group_by_length: true` is not supported with preference data"),
        ({}, {"prompt_format": "{prompt}"}, "does not read `prompt_format`"),
        ({}, {"roles_to_train": ["assistant"]}, "does not read `roles_to_train`"),
        ({"test_datasets": [{"path": "x.jsonl", "type": "chat_template"}]}, {}, "mix preference data"),
    ],
)
def test_combinations_that_cannot_work_are_refused_by_name(tmp_path, top, entry_keys, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        validate_config(pref_config(tmp_path, tmp_path / "p.jsonl", entry_keys, **top))


def test_max_prompt_len_without_preference_data_is_refused(tmp_path):
    raw = pref_config(tmp_path, tmp_path / "p.jsonl", max_prompt_len=32)
    raw["datasets"][0]["type"] = "chat_template"
    with pytest.raises(ConfigError, match="`max_prompt_len` limits the prompts of preference data"):
        validate_config(raw)


def test_axolotl_type_mapping_is_user_defined_default(tmp_path):
    raw = pref_config(tmp_path, tmp_path / "p.jsonl")
    raw["datasets"][0]["type"] = {"field_prompt": "q", "prompt_format": "Q: {prompt}"}
    e = validate_config(raw).datasets[0]
    assert (e.type, e.field_prompt, e.prompt_format) == ("user_defined.default", "q", "Q: {prompt}")


# --- prepare and cache ----------------------------------------------------------------------------------------


def test_prepare_caches_the_pairs_and_a_changed_entry_prepares_again(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(6))
    cfg = validate_config(pref_config(tmp_path, data, val_set_size=2))
    first = prepare_datasets(cfg, tiny_tokenizer)
    assert first.from_cache is False
    assert sorted(first.train.column_names) == ["chosen_ids", "prompt_ids", "rejected_ids"]
    assert (len(first.train), len(first.eval)) == (4, 2)
    assert first.stats["train"]["rows_kept"] == 6
    second = prepare_datasets(cfg, tiny_tokenizer)
    assert second.from_cache is True and second.cache_dir == first.cache_dir
    assert second.train[:] == first.train[:]

    renamed = [{"dialogue" if k == "messages" else k: v for k, v in r.items()} for r in pair_rows(6)]
    write_jsonl(tmp_path / "renamed.jsonl", renamed)
    changed = validate_config(pref_config(tmp_path, tmp_path / "renamed.jsonl", {"field_messages": "dialogue"},
                                          val_set_size=2))  # fmt: skip
    third = prepare_datasets(changed, tiny_tokenizer)
    assert third.from_cache is False and third.cache_dir != first.cache_dir
    limited_cfg = pref_config(tmp_path, data, val_set_size=2, max_prompt_len=4, excess_length_strategy="truncate")
    limited = prepare_datasets(validate_config(limited_cfg), tiny_tokenizer)
    assert limited.from_cache is False and limited.cache_dir != first.cache_dir
    assert {len(r) for r in limited.train["prompt_ids"]} == {4}


def test_exact_deduplication_drops_repeated_pairs(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(3) + pair_rows(2))
    prepared = prepare_datasets(
        validate_config(pref_config(tmp_path, data, dataset_exact_deduplication=True)), tiny_tokenizer
    )
    assert len(prepared.train) == 3
    assert prepared.stats["train"]["rows_dropped"] == {"duplicate": 2}


def test_hellbender_preprocess_prepares_a_preference_config(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(4))
    import yaml

    config = write_config(tmp_path / "config.yml", yaml.safe_dump(pref_config(tmp_path, data)))
    result = invoke("preprocess", config)
    assert result.exit_code == 0, result.output
    assert "train: 4 rows read, 4 kept" in result.output
    again = invoke("preprocess", config)
    assert "reused from cache" in again.output


def test_preprocess_names_a_bad_row(tmp_path):
    rows = pair_rows(3)
    del rows[2]["chosen"]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    import yaml

    config = write_config(tmp_path / "config.yml", yaml.safe_dump(pref_config(tmp_path, data)))
    assert_user_error(invoke("preprocess", config), "pairs.jsonl", "row 2", "no chosen answer: column `chosen`")


def test_the_bundled_dpo_example_data_reads_as_pairs(tiny_tokenizer):
    from tests.conftest import EXAMPLES

    path = EXAMPLES / "data" / "preference.jsonl"
    assert path.stat().st_size < 100_000
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 200
    ctx = preference_context(entry("chat_template.default", {}), run_cfg(), tiny_tokenizer)
    for i, row in enumerate(rows[:50]):
        out = encode_preference_row(row, i, ctx, Limits(128, None, "raise", 1), "example")
        assert out["chosen_ids"] != out["rejected_ids"]
