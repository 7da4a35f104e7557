"""Chat-template bytes and assistant masks for every codec on hand-written conversations."""

from __future__ import annotations

import pytest

from mtpc.backbones.codecs import get_codec

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4 ✓"},
]
NO_SYSTEM = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]

EXPECTED = {
    ("evabyte", 0): (
        "<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4 ✓<|eot_id|>"
    ),
    ("evabyte", 1): (
        "<bos><|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
    ),
    ("llama3_byte", 0): (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4 ✓<|eot_id|>"
    ),
    ("llama3_byte", 1): (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
    ),
}


@pytest.mark.parametrize("codec_name", ["evabyte", "tiny", "llama3_byte"])
@pytest.mark.parametrize("which", [0, 1])
def test_template_bytes(codec_name: str, which: int) -> None:
    codec = get_codec(codec_name)
    messages = [CONVERSATION, NO_SYSTEM][which]
    enc = codec.apply_chat_template(messages)
    layout = "evabyte" if codec_name == "tiny" else codec_name
    assert codec.decode_bytes(enc.ids, skip_special=False).decode() == EXPECTED[(layout, which)]
    assert len(enc.ids) == len(enc.assistant_mask)


def test_template_ids_exact() -> None:
    eva = get_codec("evabyte")
    ids = eva.apply_chat_template(NO_SYSTEM).ids
    hdr = [9, *(b + 64 for b in b"user"), 10, 10 + 64, 10 + 64]
    assert ids[:2] == [1, 9] and ids[2:8] == [b + 64 for b in b"system"]
    assert ids[8:12] == [10, 74, 74, 11] and ids[12 : 12 + len(hdr)] == hdr
    llama = get_codec("llama3_byte")
    ids = llama.apply_chat_template(NO_SYSTEM).ids
    assert ids == [256, 260, 263, 257, 264, *b"Hi", 259, 260, 261, 257, 264, *b"Yo", 259]


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    runs, start = [], None
    for i, flag in enumerate([*mask, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("codec_name", ["evabyte", "llama3_byte"])
def test_assistant_mask_covers_exactly_assistant_spans(codec_name: str) -> None:
    codec = get_codec(codec_name)
    enc = codec.apply_chat_template(CONVERSATION)
    runs = _runs(enc.assistant_mask)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for (start, end), answer in zip(runs, answers, strict=True):
        assert enc.ids[start:end] == [*codec.encode(answer), codec.eot_id]
    # the generation prompt is never a target
    prompt = codec.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)
    assert not any(prompt.assistant_mask)
