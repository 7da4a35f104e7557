"""Synthetic chat data: a seeded generator of Tülu-3-format rows with short, learnable answers.

``source`` is ``synthetic/<family>``: ``arithmetic``, ``unit_conversion``, ``string`` (reverse,
case, length, letter counts, spelling), ``sorting``, ``code`` (small Python functions from
templates), ``multi_turn`` (the second question refers to the first answer) and ``multi_answer``:
several equally valid answers drawn uniformly (``Name a capital of South Africa.`` -> ``Pretoria.``
/ ``Cape Town.`` / ``Bloemfontein.``), differing in several byte positions on purpose, so a fully
factorised draft head mixes them (``Cape toria.``) and an expressive circuit does not. Any row may
open with a system prompt, which never changes the answer.

Row ``i`` of seed ``s`` depends on ``(s, i)`` only, and so does its split (a hash): a smaller
dataset is a prefix of a larger one, and its validation rows are never training rows of the larger
one.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable
from pathlib import Path

import datasets

from mtpc.data.rows import Row, default_cache_dir, read_jsonl, write_jsonl

GENERATOR_VERSION = 1  # bump when the output changes, so that stale caches are not reused

DEFAULT_NUM_ROWS = 20_000
DEFAULT_VALIDATION_FRACTION = 0.02
SYSTEM_PROMPT_PROBABILITY = 0.15

Message = dict[str, str]

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer as briefly as possible.",
    "You are a careful tutor. Give only the answer.",
    "Be concise.",
)

WORDS = (
    "apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "peach", "plum",
    "cat", "dog", "horse", "mouse", "tiger", "zebra", "eagle", "otter", "panda", "koala",
    "river", "ocean", "cloud", "storm", "light", "stone", "tree", "flower", "garden",
    "house", "table", "chair", "window", "door", "paper", "pencil", "book", "music",
    "piano", "guitar", "violin", "rocket", "planet", "moon", "star", "comet", "robot",
    "python", "circuit", "byte", "token", "model", "data", "code", "logic", "matrix",
    "silver", "golden", "purple", "orange", "yellow",
)  # fmt: skip

# (question, answers): every answer equally likely; answers differ in several bytes.
MULTI_ANSWER_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Name a capital of South Africa.", ("Pretoria.", "Cape Town.", "Bloemfontein.")),
    ("Name a primary colour.", ("Red.", "Blue.", "Yellow.")),
    ("Name a day of the weekend.", ("Saturday.", "Sunday.")),
    ("Flip a coin.", ("Heads.", "Tails.")),
    ("Name a noble gas.", ("Helium.", "Neon.", "Argon.", "Krypton.")),
    ("Name a state of matter.", ("Solid.", "Liquid.", "Gas.")),
    ("Name a planet with rings.", ("Saturn.", "Jupiter.", "Uranus.", "Neptune.")),
    ("Name a season of the year.", ("Spring.", "Summer.", "Autumn.", "Winter.")),
    (
        "Suggest a programming language.",
        ("I suggest Python.", "I suggest Rust.", "I suggest Haskell."),
    ),
    ("Say hello.", ("Hello!", "Hi there!", "Good day!")),
)

UNITS = (
    # (from, from plural, to, to symbol, factor)
    ("km", "kilometers", "meters", "m", 1000),
    ("m", "meters", "centimeters", "cm", 100),
    ("cm", "centimeters", "millimeters", "mm", 10),
    ("kg", "kilograms", "grams", "g", 1000),
    ("h", "hours", "minutes", "min", 60),
    ("min", "minutes", "seconds", "s", 60),
    ("days", "days", "hours", "h", 24),
    ("L", "liters", "milliliters", "mL", 1000),
)

# (request, function name, body with {x} for the argument name; {y} for a second one)
CODE_TEMPLATES = (
    ("returns the square of {x}", "square", "return {x} * {x}"),
    ("returns the cube of {x}", "cube", "return {x} * {x} * {x}"),
    ("returns twice {x}", "double", "return 2 * {x}"),
    ("returns {x} plus one", "increment", "return {x} + 1"),
    ("returns the sum of {x} and {y}", "add", "return {x} + {y}"),
    ("returns the product of {x} and {y}", "multiply", "return {x} * {y}"),
    ("returns the larger of {x} and {y}", "maximum", "return {x} if {x} > {y} else {y}"),
    ("checks whether {x} is even", "is_even", "return {x} % 2 == 0"),
    ("returns the absolute value of {x}", "absolute", "return {x} if {x} >= 0 else -{x}"),
    ("reverses the string {x}", "reverse", "return {x}[::-1]"),
    ("returns the length of the list {x}", "length", "return len({x})"),
    ("returns the sum of the list {x}", "total", "return sum({x})"),
)
ARG_NAMES = (("x", "y"), ("a", "b"), ("n", "m"))


def _arithmetic(rng: random.Random) -> list[Message]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        c = a * b
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        c = a + b if op == "+" else a - b
    question = rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"))
    return _qa(question.format(a=a, op=op, b=b), f"{a} {op} {b} = {c}.")


def _convert(value: int, unit: tuple[str, str, str, str, int]) -> str:
    short, _, _, to_symbol, factor = unit
    return f"{value} {short} = {value * factor} {to_symbol}."


def _unit_conversion(rng: random.Random) -> list[Message]:
    unit = rng.choice(UNITS)
    value = rng.randint(1, 20)
    question = rng.choice(("Convert {v} {p} to {t}.", "How many {t} are in {v} {p}?"))
    return _qa(question.format(v=value, p=unit[1], t=unit[2]), _convert(value, unit))


def _string(rng: random.Random) -> list[Message]:
    word = rng.choice(WORDS)
    kind = rng.randrange(6)
    if kind == 0:
        return _qa(f'Reverse the word "{word}".', f"{word[::-1]}")
    if kind == 1:
        return _qa(f'Write "{word}" in upper case.', word.upper())
    if kind == 2:
        return _qa(f'Write "{word.upper()}" in lower case.', word)
    if kind == 3:
        return _qa(f'How many letters are in "{word}"?', f'"{word}" has {len(word)} letters.')
    if kind == 4:
        letter = rng.choice(word)
        count = word.count(letter)
        return _qa(
            f'How many times does the letter "{letter}" appear in "{word}"?',
            f'"{letter}" appears {count} time{"s" if count > 1 else ""}.',
        )
    return _qa(f'Spell "{word}" with dashes.', "-".join(word))


def _sorting(rng: random.Random) -> list[Message]:
    kind = rng.randrange(3)
    if kind == 2:
        words = rng.sample(WORDS, rng.randint(3, 5))
        return _qa(f"Sort alphabetically: {', '.join(words)}.", ", ".join(sorted(words)) + ".")
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    order = "ascending" if kind == 0 else "descending"
    answer = sorted(numbers, reverse=kind == 1)
    return _qa(
        f"Sort in {order} order: {', '.join(map(str, numbers))}.",
        ", ".join(map(str, answer)) + ".",
    )


def _code(rng: random.Random) -> list[Message]:
    request, name, body = rng.choice(CODE_TEMPLATES)
    x, y = rng.choice(ARG_NAMES)
    args = f"{x}, {y}" if "{y}" in request else x
    question = f"Write a Python function that {request.format(x=x, y=y)}."
    return _qa(question, f"def {name}({args}):\n    {body.format(x=x, y=y)}")


def _multi_turn(rng: random.Random) -> list[Message]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b, k = rng.randint(0, 50), rng.randint(0, 50), rng.randint(2, 9)
        return [
            *_qa(f"What is {a} + {b}?", f"{a} + {b} = {a + b}."),
            *_qa(f"Now multiply that by {k}.", f"{a + b} * {k} = {(a + b) * k}."),
        ]
    if kind == 1:
        word = rng.choice(WORDS)
        return [
            *_qa(f'Reverse the word "{word}".', word[::-1]),
            *_qa("Now write it in upper case.", word[::-1].upper()),
        ]
    value = rng.randint(1, 20)
    return [
        *_qa(f"Convert {value} km to meters.", _convert(value, UNITS[0])),
        *_qa("And to centimeters?", f"{value} km = {value * 100_000} cm."),
    ]


def _multi_answer(rng: random.Random) -> list[Message]:
    question, answers = rng.choice(MULTI_ANSWER_QUESTIONS)
    return _qa(question, rng.choice(answers))


def _qa(question: str, answer: str) -> list[Message]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


FAMILIES: dict[str, tuple[float, Callable[[random.Random], list[Message]]]] = {
    "arithmetic": (0.18, _arithmetic),
    "unit_conversion": (0.10, _unit_conversion),
    "string": (0.18, _string),
    "sorting": (0.10, _sorting),
    "code": (0.10, _code),
    "multi_turn": (0.12, _multi_turn),
    "multi_answer": (0.22, _multi_answer),
}  # family -> (sampling weight, generator of one row's messages)


def generate_row(index: int, seed: int = 0) -> Row:
    """Generates row ``index`` of the dataset with ``seed`` (a pure function of both)."""
    rng = random.Random(f"mtpc-synthetic-v{GENERATOR_VERSION}:{seed}:{index}")
    names = list(FAMILIES)
    family = rng.choices(names, weights=[FAMILIES[n][0] for n in names])[0]
    messages = FAMILIES[family][1](rng)
    if rng.random() < SYSTEM_PROMPT_PROBABILITY:
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}, *messages]
    return {
        "id": f"synthetic-{seed}-{index:07d}",
        "messages": messages,
        "source": f"synthetic/{family}",
    }


def generate_rows(num_rows: int, seed: int = 0) -> list[Row]:
    """Generates ``num_rows`` rows, deterministic given ``seed``; raises ValueError if < 0."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return [generate_row(index, seed) for index in range(num_rows)]


def is_validation(index: int, seed: int, validation_fraction: float) -> bool:
    """Whether row ``index`` of ``seed`` belongs to the validation split (a hash, not an RNG)."""
    digest = hashlib.sha256(f"mtpc-split:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction


def load_synthetic(
    cache_dir: str | os.PathLike[str] | None = None,
    num_rows: int = DEFAULT_NUM_ROWS,
    seed: int = 0,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> datasets.DatasetDict:
    """The synthetic dataset with ``train`` and ``validation`` splits (by ``is_validation``),
    generated into ``cache_dir`` (``default_cache_dir()`` when None) as JSON lines on first use,
    read back afterwards. ``ValueError`` for a negative ``num_rows`` or a ``validation_fraction``
    outside [0, 1)."""
    if not 0.0 <= validation_fraction < 1.0:  # a negative num_rows: generate_rows refuses it
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    key = f"synthetic-v{GENERATOR_VERSION}-n{num_rows}-seed{seed}-val{validation_fraction:g}"
    folder = Path(default_cache_dir() if cache_dir is None else cache_dir) / "synthetic" / key
    paths = {split: folder / f"{split}.jsonl" for split in ("train", "validation")}
    if not all(p.is_file() for p in paths.values()):
        rows = generate_rows(num_rows, seed)
        flags = [is_validation(i, seed, validation_fraction) for i in range(num_rows)]
        # validation first: train.jsonl is written last, so its presence marks a complete cache
        write_jsonl((r for r, v in zip(rows, flags, strict=True) if v), paths["validation"])
        write_jsonl((r for r, v in zip(rows, flags, strict=True) if not v), paths["train"])
    text = datasets.Value("string")
    messages = datasets.List({"role": text, "content": text})
    features = datasets.Features({"id": text, "messages": messages, "source": text})
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(read_jsonl(path), features=features)
            for split, path in paths.items()
        }
    )
