"""Byte codecs: round trips, chat templates against hand-written ids, assistant masks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpc.backbones.codecs import get_codec

CODEC_NAMES = ("evabyte", "tiny", "llama3_byte")

# EvaByte ids of the strings used below (byte b -> b + 64), spelled out by hand.
E_SYSTEM = [179, 185, 179, 180, 165, 173]  # "system"
E_USER = [181, 179, 165, 178]  # "user"
E_ASSISTANT = [161, 179, 179, 169, 179, 180, 161, 174, 180]  # "assistant"
E_NN = [74, 74]  # "\n\n"
E_HI = [136, 169]  # "Hi"
E_YO = [153, 175]  # "Yo"
E_S = [147]  # "S"
E_BOS, E_SH, E_EH, E_EOT = 1, 9, 10, 11


def e_header(role: list[int]) -> list[int]:
    return [E_SH, *role, E_EH, *E_NN]


# byte-level Llama 3.2: bytes are ids 0-255, then 256 bos, 257 end_header, 258 eos,
# 259 eot, 260 start_header, 261 "assistant", 262 "system", 263 "user", 264 "\n\n".
L_BOS, L_EH, L_EOT, L_SH, L_ASSISTANT, L_SYSTEM, L_USER, L_NN = (
    256,
    257,
    259,
    260,
    261,
    262,
    263,
    264,
)


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_unicode(name: str, text: str) -> None:
    codec = get_codec(name)
    ids = codec.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(codec.is_byte(i) for i in ids)
    assert codec.decode(ids) == text


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=200, deadline=None)
@given(data=st.binary())
def test_invalid_utf8_decodes_with_replacement(name: str, data: bytes) -> None:
    codec = get_codec(name)
    ids = codec.encode(data)
    assert codec.decode_bytes(ids) == data
    assert codec.decode(ids) == data.decode("utf-8", errors="replace")


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_decode_any_in_vocab_ids_never_crashes(name: str, data: st.DataObject) -> None:
    codec = get_codec(name)
    ids = data.draw(st.lists(st.integers(0, codec.vocab_size - 1), max_size=64))
    assert isinstance(codec.decode(ids), str)
    assert isinstance(codec.decode(ids, skip_special=False), str)
    kept = codec.decode_bytes(ids)
    assert len(kept) == sum(codec.is_byte(i) for i in ids)


def test_cut_multibyte_char_becomes_replacement() -> None:
    codec = get_codec("evabyte")
    ids = codec.encode("é")[:1]  # first byte of a two-byte character
    assert codec.decode(ids) == "\ufffd"
    assert codec.decode(codec.encode("a") + ids + codec.encode("b")) == "a\ufffdb"


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_out_of_vocab_id_raises(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(ValueError, match="outside"):
        codec.decode([codec.vocab_size])
    with pytest.raises(ValueError, match="outside"):
        codec.decode([-1])


def test_unknown_codec_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"codec is 'gpt2'.*evabyte"):
        get_codec("gpt2")


def test_evabyte_ids_and_specials() -> None:
    codec = get_codec("evabyte")
    assert codec.vocab_size == 320
    assert codec.encode("Hi") == E_HI
    assert codec.encode(b"\x00\xff") == [64, 319]
    assert (codec.pad_id, codec.bos_id, codec.eos_id, codec.eot_id) == (0, 1, 2, 11)
    assert codec.stop_ids == (11, 2)
    assert codec.decode([E_BOS, *E_HI, E_EOT], skip_special=False) == "<bos>Hi<|eot_id|>"
    assert get_codec("tiny").encode("Hi") == E_HI


def test_evabyte_template_generation_prompt_without_system() -> None:
    codec = get_codec("evabyte")
    enc = codec.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    expected = [
        E_BOS, *e_header(E_SYSTEM), E_EOT,  # EvaByte always opens with a (here empty) system block
        *e_header(E_USER), *E_HI, E_EOT,
        *e_header(E_ASSISTANT),
    ]  # fmt: skip
    assert enc.ids == expected
    assert not any(enc.assistant_mask)
    assert codec.generation_prompt([{"role": "user", "content": "Hi"}]) == expected


def test_evabyte_template_system_multi_turn() -> None:
    codec = get_codec("evabyte")
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hi"},
    ]
    enc = codec.apply_chat_template(messages)
    expected = [
        E_BOS, *e_header(E_SYSTEM), *E_S, E_EOT,
        *e_header(E_USER), *E_HI, E_EOT,
        *e_header(E_ASSISTANT), *E_YO, E_EOT,
        *e_header(E_USER), *E_HI, E_EOT,
        *e_header(E_ASSISTANT), *E_HI, E_EOT,
    ]  # fmt: skip
    assert enc.ids == expected
    masked = [i for i, m in zip(enc.ids, enc.assistant_mask, strict=True) if m]
    assert masked == [*E_YO, E_EOT, *E_HI, E_EOT]
    # positions: the mask is exactly the assistant contents and the eot that closes them
    first = 1 + 10 + 1 + 1 + 8 + 2 + 1 + 13
    second = first + 3 + 8 + 2 + 1 + 13
    flagged = [i for i, m in enumerate(enc.assistant_mask) if m]
    assert flagged == [first, first + 1, first + 2, second, second + 1, second + 2]


def test_llama3_byte_template() -> None:
    codec = get_codec("llama3_byte")
    assert codec.encode("Hi") == [72, 105]
    enc = codec.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert enc.ids == [
        L_BOS,
        L_SH,
        L_USER,
        L_EH,
        L_NN,
        72,
        105,
        L_EOT,
        L_SH,
        L_ASSISTANT,
        L_EH,
        L_NN,
    ]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
    ]
    enc = codec.apply_chat_template(messages)
    assert enc.ids == [
        L_BOS,
        L_SH, L_SYSTEM, L_EH, L_NN, 83, L_EOT,
        L_SH, L_USER, L_EH, L_NN, 72, 105, L_EOT,
        L_SH, L_ASSISTANT, L_EH, L_NN, 89, 111, L_EOT,
    ]  # fmt: skip
    assert enc.assistant_mask == [False] * 18 + [True] * 3
    assert codec.decode(enc.ids, skip_special=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
    )


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_mask_matches_ids_and_assistant_content(name: str) -> None:
    codec = get_codec(name)
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "Ünïcödé ✓"},
        {"role": "assistant", "content": "✓ ok"},
    ]
    enc = codec.apply_chat_template(messages)
    assert len(enc.ids) == len(enc.assistant_mask)
    masked = [i for i, m in zip(enc.ids, enc.assistant_mask, strict=True) if m]
    eot = codec.eot_id
    assert masked == [*codec.encode("2 + 2 = 4."), eot, *codec.encode("✓ ok"), eot]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_unknown_role_names_the_field(name: str) -> None:
    codec = get_codec(name)
    messages = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.role is 'tool'.*assistant"):
        codec.apply_chat_template(messages)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_non_string_content_names_the_field(name: str, role: str) -> None:
    codec = get_codec(name)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content must be a string"):
        codec.apply_chat_template([{"role": role, "content": ["Hi"]}])  # type: ignore[dict-item]
