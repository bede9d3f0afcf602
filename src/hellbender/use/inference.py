"""`hellbender inference`: answers from the trained model, streamed token by token as they are generated.

One prompt, a file of prompts (each answered on its own), or an interactive chat that keeps the conversation.
Prompts go through the model's chat template, as the training rows did (`raw` skips it, for models trained on
raw text); images go with the first user turn of a vision-language model. Decoding is greedy, and so
deterministic, unless a temperature above 0 asks for sampling.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TextStreamer

from hellbender.config import HellbenderConfig
from hellbender.errors import ConfigError, DataError, UserError
from hellbender.use.chat import render_prompt, stop_token_ids, text_message, user_message
from hellbender.use.trained import find_trained, load_trained

Write = Callable[[str], None]


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy decoding
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"`--max-new-tokens {self.max_new_tokens}`: generate at least 1 token.")
        if self.temperature < 0:
            raise UserError(f"`--temperature {self.temperature}` is negative; use 0 for greedy decoding or above 0.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"`--top-p {self.top_p}` must be above 0 and at most 1.")

    def apply(self, generation_config: Any) -> Any:
        """A copy of the model's generation config with these settings; greedy decoding clears the sampling
        parameters a model may ship with, so nothing random is left."""
        config = copy.deepcopy(generation_config)
        config.max_new_tokens = self.max_new_tokens
        config.max_length = None
        if self.temperature > 0:
            config.update(do_sample=True, temperature=self.temperature, top_p=self.top_p)
        else:
            config.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
        return config


def load_images(cfg: HellbenderConfig, paths: list[Path]) -> list[Any]:
    """The images given on the command line, decoded (and resized) as training decoded the dataset's images."""
    if not paths:
        return []
    if not cfg.is_multimodal:
        raise ConfigError(
            f"`--image` needs a vision-language model, but this config trains a text-only one (`base_model: "
            f"{cfg.base_model}`, no `processor_type`). Remove `--image`, or use the config of a vision-language run."
        )
    from hellbender.data.contexts import image_policy
    from hellbender.data.images import ImageProblem, open_image

    try:
        return [open_image(Path(p).expanduser(), image_policy(cfg)) for p in paths]
    except ImageProblem as exc:
        raise DataError(f"`--image`: {exc}.") from None


class _WritingStreamer(TextStreamer):
    """transformers' TextStreamer, writing the answer's text through `write` instead of printing it."""

    def __init__(self, tokenizer: Any, write: Write) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.write = write

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.write(text + ("\n" if stream_end else ""))


class Generator:
    """The trained model (base + adapter, a checkpoint or a merged model) with its tokenizer / processor."""

    def __init__(self, cfg: HellbenderConfig, model_dir: str | Path | None = None) -> None:
        from hellbender.models.loading import load_tokenizer_and_processor

        if cfg.tokenizer_use_mistral_common and cfg.is_multimodal:
            raise UserError(
                "Generating with a Mistral vision model under `tokenizer_use_mistral_common` is not supported yet: "
                "its prompts and images would be encoded by mistral-common, which `infer` does not drive. Load the "
                "trained output (it holds the model and its `tekken.json`) with vLLM or transformers and "
                "mistral-common directly."
            )
        self.cfg = cfg
        self.trained = find_trained(cfg, model_dir, "--model")
        self.tokenizer, self.processor = load_tokenizer_and_processor(cfg)
        self.model = load_trained(cfg, self.trained, self.tokenizer)
        self.multimodal = self.processor is not None
        self.template_owner = self.processor or self.tokenizer
        self.stop_ids = stop_token_ids(
            self.tokenizer, self.template_owner, self.multimodal, self.model.generation_config
        )

    def encode(self, prompt: str, images: list[Any], raw: bool) -> dict[str, Any]:
        # A rendered chat template holds its own BOS where the model wants one; raw text gets the tokenizer's.
        if self.processor is None:
            batch = self.tokenizer(prompt, add_special_tokens=raw, return_tensors="pt")
            batch.pop("token_type_ids", None)
            return dict(batch)
        try:
            return dict(
                self.processor(
                    text=[prompt], images=[images] if images else None, add_special_tokens=raw, return_tensors="pt"
                )
            )
        except ValueError as exc:  # e.g. raw text whose image tokens do not match the images given
            raise UserError(f"The processor refused the prompt and its {len(images)} image(s): {exc}") from None

    def generate(
        self, prompt: str, images: list[Any], settings: GenerationSettings, write: Write | None, raw: bool
    ) -> str:
        """The answer to a rendered prompt (or raw text), streamed through `write` as it is generated."""
        import torch

        batch = {k: v.to(self.model.device) for k, v in self.encode(prompt, images, raw).items()}
        config = settings.apply(self.model.generation_config)
        config.eos_token_id = self.stop_ids
        config.pad_token_id = self.tokenizer.pad_token_id
        streamer = _WritingStreamer(self.tokenizer, write) if write is not None else None
        with torch.no_grad():
            out = self.model.generate(**batch, generation_config=config, streamer=streamer)
        new_tokens = out[0, batch["input_ids"].shape[1] :]
        return self.tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


@dataclass
class Conversation:
    """The turns so far; the images go with the first user turn, as in the training rows."""

    multimodal: bool
    system: str | None = None
    images: list[Any] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [text_message("system", self.system, self.multimodal)] if self.system else []

    def ask(self, generator: Generator, text: str, settings: GenerationSettings, write: Write | None = None) -> str:
        first = not any(m["role"] == "user" for m in self.messages)
        turn = user_message(text, len(self.images) if first else 0, self.multimodal)
        prompt = render_prompt(generator.template_owner, [*self.messages, turn])
        reply = generator.generate(prompt, self.images, settings, write, raw=False)
        self.messages += [turn, text_message("assistant", reply, self.multimodal)]
        return reply


def answer(
    generator: Generator,
    prompt: str,
    images: list[Any],
    settings: GenerationSettings,
    system: str | None = None,
    raw: bool = False,
    write: Write | None = None,
) -> str:
    """The answer to one prompt, on its own (a new conversation, or raw text with `raw`)."""
    if raw:
        return generator.generate(prompt, images, settings, write, raw=True)
    return Conversation(generator.multimodal, system, images).ask(generator, prompt, settings, write)


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: one per line (blank lines skipped), or for `.jsonl` one `{"prompt": ...}` per line."""
    if not path.is_file():
        raise DataError(f"`--prompts-file {path}` does not exist or is not a file.")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"`{path}` line {number} is not JSON ({exc.msg}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(f'`{path}` line {number} needs a "prompt" string, e.g. {{"prompt": "Hello"}}.')
        prompts.append(row["prompt"])
    if not prompts:
        raise DataError(f"`--prompts-file {path}` holds no prompts.")
    return prompts


CHAT_HELP = "Type a message and press Enter. /reset starts a new conversation; /exit or Ctrl-D ends the chat."


def chat(
    generator: Generator,
    conversation: Conversation,
    settings: GenerationSettings,
    read: Callable[[str], str] = input,
    write: Write = write_stdout,
    first: str | None = None,
) -> None:
    """An interactive chat: each line read is a user turn, answered with the whole conversation before it."""
    pending = [first] if first else []
    while True:
        if pending:
            line = pending.pop()
            write(f"> {line}\n")
        else:
            try:
                line = read("> ")
            except (EOFError, KeyboardInterrupt):
                write("\n")
                return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            conversation.reset()
            write("(new conversation)\n")
            continue
        if text:
            conversation.ask(generator, text, settings, write)
