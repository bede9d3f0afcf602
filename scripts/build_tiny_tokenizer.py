"""Rebuild the byte-level BPE tokenizer of the built-in tiny models from the bundled example data.

Run from the repository root; the output is committed so every machine gets the same vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hellbender.models.tiny import SPECIAL_TOKENS, TOKENIZER_FILE

DATA = Path("src/hellbender/examples/data")


def corpus() -> list[str]:
    texts = []
    for path in sorted(DATA.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts.extend(str(v) for v in row.values() if isinstance(v, str))
            texts.extend(m["content"] for m in row.get("messages", []))
    return texts


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    TOKENIZER_FILE.write_text(tok.to_str(pretty=False))
    print(f"wrote {TOKENIZER_FILE} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
