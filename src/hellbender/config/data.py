"""Config keys for datasets: where rows come from, how they become tokens, and the prepared-data cache."""

from __future__ import annotations

from string import Formatter
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)

from hellbender.chat_templates import NAMED_TEMPLATES
from hellbender.config.distillation import KD_DATASET_TYPES
from hellbender.config.values import Float, Int, Name, PathText

# transformers' flash attention counts a packed batch's tokens in 32-bit integers.
MAX_SEQUENCE_LEN = 2**31 - 1

DsType = Literal["json", "jsonl", "parquet", "csv", "text", "arrow"]
SftDatasetType = Literal["alpaca", "chat_template", "completion", "pretokenized", "multimodal_pretrain"]
TrainOnEos = Literal["turn", "all", "last", "none"]
# Axolotl's row formats of preference data (`chatml.intel`, `chat_template.default`, ...): `<family>.<format>`.
PREFERENCE_FORMAT_FAMILIES = ("chatml", "llama3", "chat_template", "zephyr", "user_defined", "bradley_terry")
# The preference types hellbender reads: each gives (prompt, chosen, rejected) rows; under `rl: kto` the types of
# `KTO_PREFERENCE_TYPES` give unpaired (prompt, completion, label) rows instead. `chatml` / `llama3` alone are
# Axolotl's spelling of `<family>.default`.
PreferenceDatasetType = Literal[
    "chat_template.default",
    "chat_template.argilla_chat",
    "chat_template.argilla",
    "chatml",
    "chatml.default",
    "chatml.argilla",
    "chatml.argilla_chat",
    "chatml.icr",
    "chatml.intel",
    "chatml.prompt_pairs",
    "chatml.ultra",
    "llama3",
    "llama3.default",
    "llama3.argilla",
    "llama3.argilla_chat",
    "llama3.icr",
    "llama3.intel",
    "llama3.prompt_pairs",
    "llama3.ultra",
    "zephyr.nectar",
    "user_defined.default",
    "bradley_terry.chat_template",
]
PREFERENCE_TYPES: tuple[str, ...] = get_args(PreferenceDatasetType)
KTO_PREFERENCE_TYPES = tuple(
    f"{family}.{name}"
    for family in ("chatml", "llama3")
    for name in ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra")
) + ("user_defined.default",)
# The preference types whose prompts may hold images, for vision-language models (`processor_type`).
VISION_PREFERENCE_TYPES = ("chat_template.default", "chat_template.argilla_chat")
DatasetType = SftDatasetType | PreferenceDatasetType
# Axolotl's `type: module.function` for the prompt rows of online RL: a transform in a Python file (docs/rl.md).
TransformName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")]


_FORMATS = frozenset(get_args(SftDatasetType) + get_args(PreferenceDatasetType))


def is_transform_type(value: Any) -> bool:
    """`type: module.function`: a user's transform, not one of hellbender's formats."""
    return isinstance(value, str) and "." in value and value not in _FORMATS


# A dotted name that is not a format is checked as a transform name, anything else against the formats alone, so a
# misspelt format is told the formats. The tags are what an error says the key takes (`validation_errors.py` reads a
# union member's tag as its description).
_FORMATS_TAG = f"literal[{','.join(repr(v) for v in get_args(SftDatasetType) + get_args(PreferenceDatasetType))}]"
EntryType = Annotated[
    Annotated[DatasetType, Tag(_FORMATS_TAG)] | Annotated[TransformName, Tag("a transform `module.function`")],
    Discriminator(lambda value: "a transform `module.function`" if is_transform_type(value) else _FORMATS_TAG),
]
# Keys of `user_defined.default` (Axolotl writes them in a mapping under `type:`), each with Axolotl's default.
USER_DEFINED_KEYS = {
    "field_prompt": "prompt",
    "field_system": "system",
    "field_chosen": "chosen",
    "field_rejected": "rejected",
    "field_completion": "completion",
    "field_label": "label",
    "prompt_format": "{prompt}",
    "chosen_format": "{chosen}",
    "rejected_format": "{rejected}",
    "completion_format": "{completion}",
}


def is_preference_type(kind: str | None) -> bool:
    """Whether a dataset `type` is a preference-data format."""
    return kind in PREFERENCE_TYPES


# The roles of chat-template messages; dataset role names map onto these (`roles:` adds more).
CHAT_ROLES = ("system", "user", "assistant", "tool")


class ImageEntryKeys(BaseModel):
    """Per-dataset image keys of vision-language datasets (chat rows and raw image+text rows)."""

    model_config = ConfigDict(extra="forbid")

    image_column: Name = Field(
        "images",
        description="VLM: column with a list of image paths / URLs (plain-text chat rows and `multimodal_pretrain` rows).",
    )
    image_base_dir: PathText | None = Field(
        None,
        description="VLM: directory that relative image paths start from and that no image path may leave; default "
        "the dataset file's directory (the current directory for hub datasets).",
    )
    image_token: Name | None = Field(
        None,
        description="`multimodal_pretrain`: the special token that marks an image in the text; default the "
        "processor's image token.",
    )
    skip_bad_images: bool = Field(
        False,
        description="VLM: drop (and count) rows whose images are missing, corrupt or too large (`multimodal_pretrain`: "
        "or whose tokens exceed `sequence_len`) instead of failing.",
    )
    allow_remote_images: bool = Field(False, description="VLM: allow `http(s)` image URLs to be fetched.")


class DatasetEntry(ImageEntryKeys):
    """One entry of `datasets:` / `test_datasets:`."""

    model_config = ConfigDict(extra="forbid")

    path: PathText = Field(
        description="Local file, directory or glob; a hub dataset id; or an fsspec URL (s3://, gs://, az://)."
    )
    type: EntryType | None = Field(
        None,
        description="Row format. Default `pretokenized`: rows that already hold `input_ids` are passed through. "
        "Preference data (pairs of chosen and rejected answers, or KTO's labelled answers): "
        + ", ".join(f"`{name}`" for name in PREFERENCE_TYPES)
        + " (see docs/preference.md); Axolotl's mapping of `user_defined.default` keys under `type:` is read as "
        "`type: user_defined.default` with those keys. With `rl: grpo` / `rl: rloo`: `module.function`, Axolotl's "
        "prompt transform in a Python file next to the config, which maps each row to one with a `prompt` "
        "(docs/rl.md).",
    )
    ds_type: DsType | None = Field(None, description="File format; guessed from the file extension when unset.")
    data_files: list[PathText] | PathText | None = Field(
        None, description="Files inside a hub dataset or directory to load."
    )
    name: Name | None = Field(None, description="Configuration name of a hub dataset.")
    split: Name = Field("train", description="Split to load.")
    revision: Name | None = Field(None, description="Git revision of a hub dataset.")
    field: Name | None = Field(None, description="`completion`: the column holding the text (default `text`).")
    text_column: Name | None = Field(
        None, description="`completion` / `multimodal_pretrain`: the column holding the text (default `text`)."
    )
    field_messages: Name | None = Field(
        None,
        description="`chat_template`: the column holding the conversation (default `messages`, else `conversations`).",
    )
    message_property_mappings: dict[str, Name] | None = Field(
        None, description="`chat_template`: message keys for role and content, e.g. `{role: from, content: value}`."
    )
    roles: dict[str, list[Name]] | None = Field(
        None,
        description="`chat_template`: map dataset role names onto template roles, e.g. `{user: [human], assistant: [gpt]}`.",
    )
    roles_to_train: list[Name] | None = Field(
        None, description="`chat_template`: roles whose turns are trained (default `[assistant]`)."
    )
    train_on_eos: TrainOnEos | None = Field(
        None,
        description="`chat_template`: train the end-of-turn token on every trained turn (`turn`, default), every turn (`all`), the last turn only (`last`) or never (`none`).",
    )
    drop_system_message: bool = Field(
        False, description="`chat_template`: leave each conversation's system messages out (not rendered, not trained)."
    )
    field_thinking: Name | None = Field(
        None,
        description="`chat_template`: the message key holding an assistant's reasoning (default `reasoning_content`); "
        "it is given to the template under `template_thinking_key` and trained with its message.",
    )
    template_thinking_key: Name | None = Field(
        None,
        description="`chat_template`: the name the chat template reads a message's reasoning under (default "
        "`reasoning_content`, as Qwen3's template; gpt-oss's template reads `thinking`).",
    )
    field_tools: Name | None = Field(
        None,
        description="`chat_template`: the column holding each row's tool list (default `tools`), JSON schemas handed "
        "to the chat template as `tools`.",
    )
    field_chosen: Name | None = Field(
        None,
        description="Preference data: the column holding the chosen answer (default `chosen`; `chatml.default` / "
        "`llama3.default` also look for `chosen_response`).",
    )
    field_rejected: Name | None = Field(
        None,
        description="Preference data: the column holding the rejected answer (default `rejected`; `chatml.default` / "
        "`llama3.default` also look for `rejected_response`).",
    )
    field_prompt: Name | None = Field(None, description="`user_defined.default`: the prompt column (default `prompt`).")
    field_system: Name | None = Field(
        None, description="`user_defined.default`: the system-message column (default `system`; may be absent)."
    )
    field_completion: Name | None = Field(
        None, description="`user_defined.default` under `rl: kto`: the answer column (default `completion`)."
    )
    field_label: Name | None = Field(
        None,
        description="`user_defined.default` under `rl: kto`: the column saying whether the answer is desirable "
        "(true / false; default `label`).",
    )
    prompt_format: str | None = Field(
        None,
        description="`user_defined.default`: the prompt text, with `{prompt}` and optionally `{system}` (default "
        "`{prompt}`).",
    )
    chosen_format: str | None = Field(
        None, description="`user_defined.default`: the chosen answer's text, with `{chosen}` (default `{chosen}`)."
    )
    rejected_format: str | None = Field(
        None,
        description="`user_defined.default`: the rejected answer's text, with `{rejected}` (default `{rejected}`).",
    )
    completion_format: str | None = Field(
        None,
        description="`user_defined.default` under `rl: kto`: the answer's text, with `{completion}` (default "
        "`{completion}`).",
    )
    chat_template: Name | None = Field(
        None, description="Per-dataset chat template (same values as the top-level `chat_template`)."
    )
    chat_template_jinja: str | None = Field(None, description="Per-dataset Jinja template for `chat_template: jinja`.")
    train_on_inputs: bool | None = Field(None, description="Per-dataset override of the top-level `train_on_inputs`.")
    logprobs_field: Name | None = Field(
        None,
        description="With `kd_trainer`: the column holding the teacher's top-k log-probabilities per position (the "
        "token ids in `target_token_ids`), covering the row's last positions; `type: "
        "axolotl.integrations.kd.chat_template` is `chat_template` with this set to `logprobs`. See "
        "docs/distillation.md.",
    )
    temperature: Float | None = Field(
        None,
        gt=0,
        description="With `logprobs_field`: the temperature the teacher's log-probabilities were taken at (default "
        "1); they are rescaled to `kd_temperature`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _kd_chat_type(cls, data: Any) -> Any:
        """Axolotl's KD dataset types are chat rows carrying the teacher's top-k: `chat_template` with
        `logprobs_field` (Axolotl's default column name `logprobs`)."""
        if not isinstance(data, dict) or data.get("type") not in KD_DATASET_TYPES:
            return data
        return {**data, "type": "chat_template", "logprobs_field": data.get("logprobs_field") or "logprobs"}

    @model_validator(mode="before")
    @classmethod
    def _user_defined_mapping(cls, data: Any) -> Any:
        """Axolotl writes `user_defined.default` as a mapping of its keys under `type:`; they are entry keys here."""
        if not isinstance(data, dict) or not isinstance(data.get("type"), dict):
            return data
        unknown = sorted(str(key) for key in data["type"] if key not in USER_DEFINED_KEYS)
        if unknown:
            raise ValueError(
                f"`type:` is a mapping (Axolotl's `user_defined.default`) with the key(s) {', '.join(unknown)}, which "
                f"it does not read; its keys are {', '.join(USER_DEFINED_KEYS)}"
            )
        clash = sorted(key for key in data["type"] if key in data)
        if clash:
            raise ValueError(
                f"{', '.join(f'`{key}`' for key in clash)} is set both under `type:` and in the entry; keep one"
            )
        return {**data, **data["type"], "type": "user_defined.default"}

    @field_validator("prompt_format", "chosen_format", "rejected_format", "completion_format")
    @classmethod
    def _format_names_only_its_fields(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return value
        allowed = {
            "prompt_format": ("prompt", "system"),
            "chosen_format": ("chosen",),
            "rejected_format": ("rejected",),
            "completion_format": ("completion",),
        }[info.field_name]
        try:
            names = [name for _, name, _, _ in Formatter().parse(value) if name is not None]
        except ValueError as exc:
            raise ValueError(f"is not a format string ({exc}); write `{{{{` and `}}}}` for literal braces") from None
        wrong = [name for name in names if name not in allowed]
        if wrong:
            raise ValueError(
                f"`{info.field_name}` names `{{{wrong[0]}}}`; it may only hold {', '.join(f'`{{{n}}}`' for n in allowed)} (write `{{{{` "
                "and `}}` for literal braces)"
            )
        return value

    @field_validator("template_thinking_key")
    @classmethod
    def _thinking_key_is_not_a_message_key(cls, value: str | None) -> str | None:
        if value in ("role", "content"):
            raise ValueError(
                f"`{value}` is the template's name for a message's {value}; name the key the template reads the "
                "reasoning under (gpt-oss: `thinking`, Qwen3: `reasoning_content`)"
            )
        return value

    @field_validator("type", mode="before")
    @classmethod
    def _dotted_types_say_what_they_are(cls, value: Any) -> Any:
        """Axolotl's dotted types are preference-data formats or a transform function from a Python file."""
        if value == "stepwise_supervised":
            raise ValueError(
                "`stepwise_supervised` is process-reward data (reasoning steps, each labelled right or wrong); it "
                "belongs to process reward models, which hellbender does not offer yet"
            )
        if not isinstance(value, str) or "." not in value or value in PREFERENCE_TYPES:
            return value
        if value.split(".")[0] in PREFERENCE_FORMAT_FAMILIES:
            raise ValueError(
                f"`{value}` is not a preference-data format hellbender reads; the preference formats are "
                + ", ".join(f"`{name}`" for name in PREFERENCE_TYPES)
            )
        return value  # a transform function: `rl_checks.py` refuses it except for online RL's prompt rows


class PretrainingDatasetEntry(ImageEntryKeys):
    """One entry of `pretraining_dataset:` (raw text or raw image+text, streamed unless `streaming: false`)."""

    model_config = ConfigDict(extra="forbid")

    path: PathText = Field(description="Local file, directory or glob; a hub dataset id; or an fsspec URL.")
    type: Literal["completion", "pretrain", "multimodal_pretrain"] = Field(
        "pretrain", description="Raw text documents, or `multimodal_pretrain` for raw image+text documents."
    )
    ds_type: DsType | None = Field(None, description="File format; guessed from the extension when unset.")
    data_files: list[PathText] | PathText | None = Field(None, description="Files inside a hub dataset or directory.")
    name: Name | None = Field(None, description="Configuration name of a hub dataset.")
    split: Name = Field("train", description="Split to stream.")
    revision: Name | None = Field(None, description="Git revision of a hub dataset.")
    text_column: Name = Field("text", description="The column holding the text.")
    field: Name | None = Field(None, description="Axolotl's name for `text_column`, read as it.")

    @model_validator(mode="after")
    def _field_is_the_text_column(self) -> PretrainingDatasetEntry:
        if self.field is None:
            return self
        if "text_column" in self.model_fields_set and self.text_column != self.field:
            raise ValueError(
                f"`field: {self.field}` and `text_column: {self.text_column}` both name the text column; keep one"
            )
        return self.model_copy(update={"text_column": self.field, "field": None})


class DataSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetEntry] = Field(default_factory=list, description="Training datasets, mixed together.")
    test_datasets: list[DatasetEntry] = Field(default_factory=list, description="Evaluation datasets.")
    pretraining_dataset: list[PretrainingDatasetEntry] = Field(
        default_factory=list, description="Streamed raw-text datasets for continued pretraining (needs `max_steps`)."
    )
    streaming: bool | None = Field(
        None,
        description="Stream the training rows instead of preparing them (needs `max_steps`): `pretraining_dataset` "
        "(default true there), or with `true` the `datasets:` rows, tokenized and masked as they are read.",
    )
    streaming_multipack_buffer_size: Int = Field(
        10_000,
        gt=0,
        description="Streamed data: rows held in the buffer that shuffles the stream (with `shuffle_merged_datasets`), "
        "and streamed `datasets:` rows gathered and packed together with `sample_packing` "
        "(`pretrain_multipack_buffer_size`, the older spelling, is read as this).",
    )
    pretrain_multipack_attn: bool = Field(
        True,
        description="Streamed `pretraining_dataset` text: keep each packed document's attention to itself (`true`); "
        "`false` lets a bin's tokens attend to every earlier token of the bin, across documents, as one sequence.",
    )
    val_set_size: Float = Field(
        0.0, ge=0, description="Hold out this fraction (< 1) or number of rows (>= 1) of `datasets` for evaluation."
    )
    dataset_prepared_path: PathText | None = Field(
        None, description="Directory of the prepared-dataset cache; default `last_run_prepared` beside `output_dir`."
    )
    dataset_num_proc: Int = Field(
        1, gt=0, description="Processes used to tokenize (`dataset_processes`, the older spelling, is read as this)."
    )
    sequence_len: Int = Field(
        2048,
        gt=1,
        le=MAX_SEQUENCE_LEN,
        description="Maximum tokens per row (and per packed bin); at most 2**31 - 1, as transformers counts a packed "
        "batch's tokens in 32-bit integers (flash attention's `cu_seqlens`). Online RL (`rl: grpo`, `rloo`) does not "
        "cut prompts; `hellbender plan` reads it there as the longest prompt plus `trl.max_completion_length`.",
    )
    excess_length_strategy: Literal["drop", "truncate", "raise"] = Field(
        "drop",
        description="Rows longer than `sequence_len`: `drop` and count them, `truncate` them, or `raise` an error naming the row.",
    )
    max_prompt_len: Int | None = Field(
        None,
        gt=0,
        description="Preference data: prompts longer than this many tokens follow `excess_length_strategy` "
        "(`truncate` keeps the prompt's last tokens, next to the answer; `drop` drops and counts the row; `raise` "
        "fails naming it). Default: no limit of its own (prompt and answer together must fit `sequence_len`).",
    )
    sample_packing: bool | None = Field(
        None,
        description="Pack several rows into each `sequence_len` bin. Default: on for streamed raw text (always packed "
        "into full bins), off otherwise.",
    )
    eval_sample_packing: bool | None = Field(
        None, description="Pack the evaluation rows too; default: as `sample_packing`."
    )
    pad_to_sequence_len: bool = Field(
        False,
        description="Pad every batch to `sequence_len` tokens, so each step has the same shapes (steadier memory, "
        "compiled kernels reused); padding is never attended to or trained.",
    )
    train_on_inputs: bool = Field(False, description="Also train on prompt / user tokens.")
    chat_template: Name | None = Field(
        None,
        description="Chat template: `tokenizer_default` (default: the model's own), a named template ("
        + ", ".join(f"`{name}`" for name in NAMED_TEMPLATES)
        + "), `tokenizer_default_fallback_<name>` (the model's own if it has one, else the named one), or `jinja` "
        "with `chat_template_jinja`.",
    )
    chat_template_jinja: str | None = Field(
        None, description="A Jinja chat template, used with `chat_template: jinja`."
    )
    eot_tokens: list[Name] = Field(
        default_factory=list,
        description="`chat_template`: the tokens that end a turn, for `train_on_eos` (each must be one token of the "
        "tokenizer). Default: the first special token the template writes after a turn's text.",
    )
    shuffle_merged_datasets: bool | None = Field(
        None,
        description="Shuffle the rows of all datasets together (once, when the data is prepared; streamed data: "
        "through a buffer of `streaming_multipack_buffer_size` rows, reshuffled on each pass). Default: on, off with "
        "`curriculum_sampling`; when off, `val_set_size` holds rows out without reordering the rest.",
    )
    dataset_exact_deduplication: bool = Field(
        False,
        description="Drop tokenized rows identical to an earlier one (same tokens and labels), within the training "
        "rows (before `val_set_size` holds rows out, so held-out rows never repeat a training row) and within "
        "`test_datasets`; the first of each is kept. Rows of `test_datasets` that also appear in `datasets` are kept.",
    )
    min_sample_len: Int = Field(
        2,
        ge=1,
        description="Drop (and count) rows of fewer tokens than this (a row of exactly this many is kept). The "
        "default 2 drops nothing more: a shorter row has no token to train anyway.",
    )
    group_by_length: bool = Field(
        False,
        description="Draw training batches of similar row lengths (transformers' length-grouped sampler: "
        "shuffled each epoch, then sorted by length within groups of up to 50 optimizer steps' rows), so less of each "
        "batch is padding. Not with `sample_packing` (packed bins have no lengths to group).",
    )
    sample_packing_sequentially: bool | None = Field(
        None,
        description="Pack rows into bins in dataset order (each row goes into the current bin, or starts the next "
        "one when it does not fit) instead of the best fit, which sorts rows by length. Default: on with "
        "`curriculum_sampling`, off otherwise.",
    )
    curriculum_sampling: bool = Field(
        False,
        description="Train on the rows (or packed bins) in dataset order, every epoch, instead of shuffled: the "
        "merged rows are not shuffled and the batches are drawn in order.",
    )
    skip_prepare_dataset: bool = Field(
        False,
        description="Use already-tokenized `multimodal_pretrain` rows (`_mm_text`, `images`, `input_ids`, "
        "`attention_mask`, `labels`) as they are; the processor expands their images at batch time. On "
        "`chat_template` datasets (Axolotl: tokenize each batch as it is drawn) it changes nothing: conversations "
        "are prepared once before training, with the same tokens and labels.",
    )

    @field_validator("val_set_size")
    @classmethod
    def _a_fraction_or_a_count(cls, value: float) -> float:
        if value >= 1 and not value.is_integer():
            raise ValueError(
                "is neither a fraction below 1 (`0.05` holds out 5% of the rows) nor a whole number of rows "
                f"(`{int(value)}`)"
            )
        return value
