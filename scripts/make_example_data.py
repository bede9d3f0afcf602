"""Regenerate the small datasets bundled with the examples (deterministic; run from the repository root)."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path("src/hellbender/examples/data")

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Brazil": "Brasilia",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Turkey": "Ankara",
    "Iran": "Tehran",
}
WORDS = [
    "river",
    "stone",
    "cloud",
    "apple",
    "tiger",
    "lamp",
    "green",
    "quiet",
    "orange",
    "silver",
    "window",
    "garden",
    "music",
    "paper",
    "bread",
]


def chat_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        kind = rng.choice(["capital", "add", "reverse"])
        if kind == "capital":
            country, city = rng.choice(sorted(CAPITALS.items()))
            q, a = f"What is the capital of {country}?", f"The capital of {country} is {city}."
        elif kind == "add":
            x, y = rng.randint(0, 9), rng.randint(0, 9)
            q, a = f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}."
        else:
            words = rng.sample(WORDS, 3)
            q, a = f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
        rows.append({"messages": messages})
    return rows


def alpaca_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        country, city = rng.choice(sorted(CAPITALS.items()))
        rows.append({"instruction": "Name the capital city.", "input": country, "output": city})
    return rows


def text_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        country, city = rng.choice(sorted(CAPITALS.items()))
        words = rng.sample(WORDS, 4)
        rows.append({"text": f"{city} is the capital of {country}. The {words[0]} by the {words[1]} was {words[2]}."})
    return rows


SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220)}


def shape_rows(rng: random.Random, n: int) -> list[dict]:
    """Images of a coloured square on white (32x32 PNG) and the question of its colour; every fifth row
    shows two squares and asks for both colours."""
    from PIL import Image

    image_dir = OUT / "shapes"
    image_dir.mkdir(exist_ok=True)

    def draw(index: int, colour: str) -> str:
        img = Image.new("RGB", (32, 32), (255, 255, 255))
        x, y = rng.randint(2, 14), rng.randint(2, 14)
        img.paste(SHAPE_COLOURS[colour], (x, y, x + 16, y + 16))
        name = f"shapes/{index:03d}.png"
        img.save(OUT / name, optimize=True)
        return name

    rows, index = [], 0
    for i in range(n):
        colours = [rng.choice(sorted(SHAPE_COLOURS)) for _ in range(2 if i % 5 == 4 else 1)]
        parts = []
        for colour in colours:
            parts.append({"type": "image", "path": draw(index, colour), "text": None})
            index += 1
        if len(colours) == 1:
            question, answer = "What colour is the square?", f"The square is {colours[0]}."
        else:
            question, answer = "What colours are the two squares?", f"The squares are {colours[0]} and {colours[1]}."
        parts.append({"type": "text", "path": None, "text": question})
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": parts},
                    {"role": "assistant", "content": [{"type": "text", "path": None, "text": answer}]},
                ]
            }
        )
    return rows


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def shape_pretrain_rows(chat_rows: list[dict]) -> list[dict]:
    """Raw image+text documents over the same images, in the tiny Qwen2.5-VL's image-token syntax."""
    rows = []
    for chat in chat_rows:
        images = [p["path"] for p in chat["messages"][0]["content"] if p["type"] == "image"]
        answer = chat["messages"][1]["content"][0]["text"]
        colours = [w.strip(".,") for w in answer.split() if w.strip(".,") in SHAPE_COLOURS]
        text = " ".join(f"{QWEN_IMAGE}A {c} square on a white background." for c in colours)
        rows.append({"text": text, "images": images})
    return rows


def preference_rows(rng: random.Random, n: int) -> list[dict]:
    """`chat_template.default` preference pairs with a learnable preference: the right capital over a wrong one, and
    a calm answer over a shouted one."""
    countries = sorted(CAPITALS)
    rows = []
    for i in range(n):
        country = rng.choice(countries)
        if i % 3:
            wrong = rng.choice([c for c in countries if c != country])
            prompt = f"What is the capital of {country}?"
            chosen = f"The capital of {country} is {CAPITALS[country]}."
            rejected = f"The capital of {country} is {CAPITALS[wrong]}."
        else:
            word = rng.choice(WORDS)
            prompt = f"Tell me about the {word}."
            chosen = f"The {word} is calm and quiet."
            rejected = f"THE {word.upper()} IS LOUD!"
        rows.append(
            {
                "messages": [{"role": "user", "content": prompt}],
                "chosen": {"role": "assistant", "content": chosen},
                "rejected": {"role": "assistant", "content": rejected},
            }
        )
    return rows


def write_jsonl(name: str, rows: list[dict]) -> None:
    with open(OUT / name, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    write_jsonl("chat.jsonl", chat_rows(rng, 400))
    write_jsonl("alpaca.jsonl", alpaca_rows(rng, 200))
    write_jsonl("text.jsonl", text_rows(rng, 400))
    shapes = shape_rows(rng, 60)
    write_jsonl("shapes.jsonl", shapes)
    write_jsonl("shapes_pretrain.jsonl", shape_pretrain_rows(shapes))
    write_jsonl("preference.jsonl", preference_rows(random.Random(1), 300))
