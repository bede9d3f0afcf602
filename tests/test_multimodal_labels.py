"""Exact labels of vision-language chat rows, for each tiny model family.

The expected rows are built here, independently of hellbender's labelling code: each family's chat format and
image expansion are written out from the tiny builders' docstrings as a list of pieces (markup, message text,
image, end-of-turn token). The pieces give the rendered text, the expanded token ids (checked against the
family's own transformers processor run on that text) and the labels: the ids of the trained messages' text
plus the end-of-turn token as `train_on_eos` says, -100 everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from hellbender.config import validate_config
from hellbender.data.contexts import format_context
from hellbender.data.formats.multimodal_chat import tokenize_row
from hellbender.errors import ConfigError
from hellbender.models.loading import load_tokenizer_and_processor

IGNORE = -100

QUESTION, ANSWER, FOLLOW_UP, ANSWER_2 = "What colour?", "Red and green.", "Are you sure?", "Yes."

# A piece of a rendered conversation:
#   ("markup", text)                    template text, never trained
#   ("content", text, message_index)    a message's text part
#   ("image", placeholder, expansion)   the placeholder the template writes, and what the processor makes of it
#   ("eot", token, message_index)       the end-of-turn token after a message
Piece = tuple


def _parts(message):
    content = message["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def render_qwen(messages) -> list[Piece]:
    """ChatML with `<|vision_start|><|image_pad|><|vision_end|>` per image; a 32x32 image is 4 soft tokens."""
    image = (
        "image",
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>",
    )
    out = []
    for i, m in enumerate(messages):
        out.append(("markup", f"<|im_start|>{m['role']}\n"))
        out += [image if p["type"] == "image" else ("content", p["text"], i) for p in _parts(m)]
        out += [("eot", "<|im_end|>", i), ("markup", "\n")]
    return out


def render_gemma4(messages) -> list[Piece]:
    """Gemma turns (`assistant` -> `model`); `<image_soft_token>` per image, expanded to BOI + 64 soft + EOI."""
    image = ("image", "<image_soft_token>", "<start_of_image>" + "<image_soft_token>" * 64 + "<end_of_image>")
    out = []
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(("markup", f"<start_of_turn>{role}\n"))
        out += [image if p["type"] == "image" else ("content", p["text"], i) for p in _parts(m)]
        out += [("eot", "<end_of_turn>", i), ("markup", "\n")]
    return out


def render_llava(messages) -> list[Piece]:
    """`USER: <image>\\ntext ASSISTANT: answer<|endoftext|>`; an image is 16 `<image>` tokens, followed by a
    newline unless it is the message's last part. User turns end with a space (no end-of-turn token)."""
    image = ("image", "<image>", "<image>" * 16)
    out = []
    for i, m in enumerate(messages):
        parts = _parts(m)
        out.append(("markup", "USER: " if m["role"] == "user" else "ASSISTANT: "))
        for k, p in enumerate(parts):
            if p["type"] == "image":
                out.append(image)
                if k < len(parts) - 1:
                    out.append(("markup", "\n"))
            else:
                out.append(("content", p["text"], i))
        out.append(("markup", " ") if m["role"] == "user" else ("eot", "<|endoftext|>", i))
    return out


def _idefics3_square_image() -> str:
    """A square image is resized to 64x64: 2x2 tiles of 32 px plus a global view, 4 `<image>` tokens each."""
    tile = "<image>" * 4
    rows = "".join("".join(f"<fake_token_around_image><row_{r}_col_{c}>{tile}" for c in (1, 2)) + "\n" for r in (1, 2))
    return rows + f"\n<fake_token_around_image><global-img>{tile}<fake_token_around_image>"


def render_idefics3(messages) -> list[Piece]:
    """SmolVLM: `<|im_start|>User:<image>text<end_of_utterance>\\n<|im_start|>Assistant: answer<end_of_utterance>\\n`
    (a space after `Role:` unless the content starts with an image)."""
    image = ("image", "<image>", _idefics3_square_image())
    out = []
    for i, m in enumerate(messages):
        parts = _parts(m)
        starts_with_image = bool(parts) and parts[0]["type"] == "image"
        out.append(("markup", f"<|im_start|>{m['role'].capitalize()}:" + ("" if starts_with_image else " ")))
        out += [image if p["type"] == "image" else ("content", p["text"], i) for p in parts]
        out += [("eot", "<end_of_utterance>", i), ("markup", "\n")]
    return out


@dataclass(frozen=True)
class Family:
    render: Callable[[list], list[Piece]]
    eot: str
    vision_tokens: tuple[str, ...]  # tokens that belong to images, by the family's own names
    image_token: str


FAMILIES = {
    "hellbender/tiny-qwen2.5-vl": Family(
        render_qwen,
        "<|im_end|>",
        ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
        "<|image_pad|>",
    ),
    "hellbender/tiny-gemma4-vlm": Family(
        render_gemma4,
        "<end_of_turn>",
        ("<image_soft_token>", "<start_of_image>", "<end_of_image>", "<|video|>"),
        "<image_soft_token>",
    ),
    "hellbender/tiny-llava": Family(render_llava, "<|endoftext|>", ("<image>",), "<image>"),
    "hellbender/tiny-idefics3": Family(
        render_idefics3,
        "<end_of_utterance>",
        ("<image>", "<fake_token_around_image>", "<global-img>")
        + tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
        "<image>",
    ),
}


def expected_row(
    render, messages, tokenizer, roles_to_train=("assistant",), train_on_eos="turn", train_on_inputs=False
):
    """(rendered text, expanded ids, labels) of a conversation, from the pieces `render` gives. With
    `train_on_inputs` every token is trained except the image expansions."""
    pieces = render(messages)
    trained_message = [m["role"] in roles_to_train for m in messages]
    last_trained = max((i for i, t in enumerate(trained_message) if t), default=-1)
    eos_rule = {
        "turn": lambda i: trained_message[i],
        "all": lambda i: True,
        "last": lambda i: i == last_trained,
        "none": lambda i: False,
    }[train_on_eos]
    # (kind, rendered string, string to tokenize, trained); neighbouring markup is tokenized together, as it
    # stands in the full text.
    chunks: list[tuple[str, str, str, bool]] = []
    for piece in pieces:
        kind = piece[0]
        if kind == "markup" and chunks and chunks[-1][0] == "markup":
            merged = chunks.pop()[1] + piece[1]
            chunks.append(("markup", merged, merged, False))
        elif kind == "markup":
            chunks.append(("markup", piece[1], piece[1], False))
        elif kind == "content":
            chunks.append((kind, piece[1], piece[1], train_on_inputs or trained_message[piece[2]]))
        elif kind == "image":
            chunks.append((kind, piece[1], piece[2], False))
        else:
            chunks.append((kind, piece[1], piece[1], train_on_inputs or eos_rule(piece[2])))
    text, ids, labels = "", [], []
    for kind, rendered, source, trained in chunks:
        chunk_ids = tokenizer(source, add_special_tokens=False)["input_ids"]
        text += rendered
        ids += chunk_ids
        labels += chunk_ids if trained or (train_on_inputs and kind == "markup") else [IGNORE] * len(chunk_ids)
    return text, ids, labels


def user(*parts):
    return {"role": "user", "content": list(parts)}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def image(path):
    return {"type": "image", "path": path}


def text(value):
    return {"type": "text", "text": value}


def two_turns(*image_names, image_first=True):
    first = [image(n) for n in image_names]
    first = [*first, text(QUESTION)] if image_first else [text(QUESTION), *first]
    return [user(*first), assistant(ANSWER), user(text(FOLLOW_UP)), assistant(ANSWER_2)]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("images")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(d / "red.png")
    Image.new("RGB", (32, 32), (30, 200, 30)).save(d / "green.png")
    Image.new("RGB", (64, 32), (30, 30, 200)).save(d / "wide.png")  # width 64, height 32
    return d


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """name -> (tokenizer, processor), each loaded once through hellbender's own loading path."""
    out = {}
    for name in FAMILIES:
        cfg = _config(name, tmp_path_factory.mktemp("cfg"), Path("."))
        out[name] = load_tokenizer_and_processor(cfg)
    return out


def _config(name, tmp: Path, image_dir: Path, entry=None, **top):
    return validate_config(
        {
            "base_model": name,
            "processor_type": "AutoProcessor",
            "datasets": [
                {
                    "path": str(tmp / "rows.jsonl"),
                    "type": "chat_template",
                    "image_base_dir": str(image_dir),
                    **(entry or {}),
                }
            ],
            "dataset_prepared_path": str(tmp / "prepared"),
            "output_dir": str(tmp / "out"),
            **top,
        }
    )


@dataclass
class Vlm:
    name: str
    family: Family
    tokenizer: object
    processor: object
    image_dir: Path
    tmp: Path

    def ctx(self, entry=None, **top):
        cfg = _config(self.name, self.tmp, self.image_dir, entry, **top)
        return format_context(cfg.datasets[0], cfg, self.tokenizer, self.processor)

    def expected(self, messages, **kwargs):
        return expected_row(self.family.render, messages, self.tokenizer, **kwargs)

    def ids_of(self, tokens) -> set[int]:
        ids = set(self.tokenizer.convert_tokens_to_ids(list(tokens)))
        assert self.tokenizer.unk_token_id not in ids and None not in ids
        return ids

    def truth(self, rendered: str, image_names) -> list[int]:
        """The family's processor on the rendered text: the ground truth of the image expansion."""
        images = [Image.open(self.image_dir / n).convert("RGB") for n in image_names]
        out = self.processor(text=[rendered], images=[images] if images else None, add_special_tokens=False)
        return list(out["input_ids"][0])


@pytest.fixture(params=list(FAMILIES), ids=lambda n: n.split("/")[-1])
def vlm(request, loaded, image_dir, tmp_path) -> Vlm:
    name = request.param
    tokenizer, processor = loaded[name]
    return Vlm(name, FAMILIES[name], tokenizer, processor, image_dir, tmp_path)


@pytest.fixture
def qwen(loaded, image_dir, tmp_path) -> Vlm:
    name = "hellbender/tiny-qwen2.5-vl"
    tokenizer, processor = loaded[name]
    return Vlm(name, FAMILIES[name], tokenizer, processor, image_dir, tmp_path)


def trained_ids(labels):
    return [x for x in labels if x != IGNORE]


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("images", [("red.png",), ("red.png", "green.png")], ids=["one_image", "two_images"])
def test_labels_are_exactly_the_assistant_answers_and_their_end_of_turn(vlm, images):
    messages = two_turns(*images)
    out = tokenize_row({"messages": messages}, vlm.ctx())
    rendered, ids, labels = vlm.expected(messages)

    assert ids == vlm.truth(rendered, images), "the test's model of the chat format is wrong"
    assert out["text"] == rendered
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert out["images"] == [str((vlm.image_dir / n).resolve()) for n in images]
    # Readable form of the same: only the two answers and their end-of-turn tokens are trained.
    eot = vlm.family.eot
    assert vlm.tokenizer.decode(trained_ids(out["labels"])) == f"{ANSWER}{eot}{ANSWER_2}{eot}"
    never = vlm.ids_of(vlm.family.vision_tokens) | {vlm.tokenizer.pad_token_id, vlm.processor.image_token_id}
    assert not never & set(out["labels"])
    # Each image really was expanded (more than its one placeholder), and none of it is trained.
    n_image = out["input_ids"].count(vlm.processor.image_token_id)
    assert n_image > len(images)


def test_training_user_turns_trains_their_text_but_never_image_tokens(vlm):
    messages = two_turns("red.png", "green.png")
    out = tokenize_row({"messages": messages}, vlm.ctx({"roles_to_train": ["user", "assistant"]}))
    rendered, ids, labels = vlm.expected(messages, roles_to_train=("user", "assistant"))

    assert ids == vlm.truth(rendered, ["red.png", "green.png"])
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    decoded = vlm.tokenizer.decode(trained_ids(out["labels"]))
    assert QUESTION in decoded and FOLLOW_UP in decoded and ANSWER in decoded
    assert not vlm.ids_of(vlm.family.vision_tokens) & set(out["labels"])


def test_user_turn_ending_with_an_image_keeps_its_end_of_turn(vlm):
    """User text, then the image: with user turns trained, the user's end-of-turn token is trained
    (train_on_eos: turn) and the image tokens are not."""
    messages = two_turns("red.png", image_first=False)
    out = tokenize_row({"messages": messages}, vlm.ctx({"roles_to_train": ["user", "assistant"]}))
    rendered, ids, labels = vlm.expected(messages, roles_to_train=("user", "assistant"))

    assert ids == vlm.truth(rendered, ["red.png"])
    assert out["input_ids"] == ids
    assert not vlm.ids_of(vlm.family.vision_tokens) & set(out["labels"])
    # Decoded first, for a readable failure: the user's text and its end-of-turn token, then the answers.
    assert vlm.tokenizer.decode(trained_ids(out["labels"])) == vlm.tokenizer.decode(trained_ids(labels))
    assert out["labels"] == labels


def test_train_on_inputs_trains_every_token_except_the_image_expansions(vlm):
    messages = two_turns("red.png", "green.png")
    out = tokenize_row({"messages": messages}, vlm.ctx(train_on_inputs=True))
    _, ids, labels = vlm.expected(messages, train_on_inputs=True)
    never = vlm.ids_of(vlm.family.vision_tokens)

    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert not never & set(out["labels"])
    # Everything outside the images is trained (Idefics3's expansions also hold the newlines between tile rows).
    outside = [i for i in ids if i not in never]
    layout_newlines = 2 * _idefics3_square_image().count("\n") if vlm.name.endswith("idefics3") else 0
    assert len(trained_ids(labels)) == len(outside) - layout_newlines
    assert sum(1 for i in out["input_ids"] if i in never) > 2  # there were image tokens to leave out


@pytest.mark.parametrize("mode", ["all", "last", "none"])
def test_train_on_eos_variants(qwen, mode):
    messages = two_turns("red.png")
    out = tokenize_row({"messages": messages}, qwen.ctx({"train_on_eos": mode}))
    rendered, ids, labels = qwen.expected(messages, train_on_eos=mode)

    assert out["input_ids"] == ids
    assert out["labels"] == labels
    im_end = qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # 4 turns: `all` trains every turn's <|im_end|>, `last` only the final answer's, `none` none.
    assert out["labels"].count(im_end) == {"all": 4, "last": 1, "none": 0}[mode]
    if mode == "last":
        assert out["labels"][len(ids) - 2] == im_end  # the last <|im_end|>, before the final newline


def test_vision_tokens_to_mask_adds_a_token_that_is_never_trained(qwen):
    messages = two_turns("red.png")
    out = tokenize_row({"messages": messages}, qwen.ctx(vision_tokens_to_mask=["<|im_end|>"]))
    _, ids, labels_without_eot = qwen.expected(messages, train_on_eos="none")

    assert out["input_ids"] == ids
    assert out["labels"] == labels_without_eot
    assert qwen.tokenizer.convert_tokens_to_ids("<|im_end|>") in ids  # it is there, just not trained


def test_vision_tokens_to_mask_with_an_unknown_token_is_a_config_error(qwen):
    with pytest.raises(ConfigError, match="<no_such_token>"):
        qwen.ctx(vision_tokens_to_mask=["<no_such_token>"])


def _runs(ids, token_id):
    runs, current = [], 0
    for t in [*ids, None]:
        if t == token_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_image_column_puts_every_image_in_order_before_the_first_user_text(vlm):
    plain = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": FOLLOW_UP},
        {"role": "assistant", "content": ANSWER_2},
    ]
    ctx = vlm.ctx()
    legacy = tokenize_row({"messages": plain, "images": ["red.png", "green.png"]}, ctx)
    parts = tokenize_row({"messages": two_turns("red.png", "green.png")}, ctx)

    assert legacy == parts
    placeholder = vlm.family.image_token
    first_text = legacy["text"].index(QUESTION)
    assert legacy["text"].count(placeholder) == 2
    assert legacy["text"].rfind(placeholder) < first_text
    assert legacy["text"].find(placeholder, first_text) == -1
    # One run of image tokens per image; Idefics3 splits each image into 5 tiles, each its own run.
    runs = _runs(legacy["input_ids"], vlm.processor.image_token_id)
    assert len(runs) == (10 if vlm.name.endswith("idefics3") else 2)
    assert legacy["images"] == [str((vlm.image_dir / n).resolve()) for n in ("red.png", "green.png")]


@pytest.mark.parametrize("order", [("wide.png", "red.png"), ("red.png", "wide.png")])
def test_image_column_keeps_the_order_of_differently_sized_images(qwen, order):
    plain = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    out = tokenize_row({"messages": plain, "images": list(order)}, qwen.ctx())
    tokens = {"wide.png": 2, "red.png": 4}  # 64x32 -> 16x8 px: 2 soft tokens; 32x32 -> 16x16: 4

    assert _runs(out["input_ids"], qwen.processor.image_token_id) == [tokens[n] for n in order]
    assert out["text"].startswith("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * 2 + QUESTION)
