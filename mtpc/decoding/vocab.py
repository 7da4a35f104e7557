"""Byte-aware tokenizer adapters (byte codecs, HF tokenizers) and the target/drafter
vocabulary mapping, tokens compared by the bytes they decode to. See docs/HETERO.md,
"Algorithms"."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

import torch
from torch import Tensor

from mtpc.backbones.codecs import ByteCodec


class HeteroVocabularyError(ValueError):
    """The two vocabularies cannot work together for the requested algorithm."""


class InexpressibleTextError(HeteroVocabularyError):
    """A tokenizer cannot express a text (unknown or dropped characters)."""


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (``"Ġ"`` is the space byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    table = {b: chr(b) for b in [*printable, *range(ord("®"), ord("ÿ") + 1)]}
    moved = [b for b in range(256) if b not in table]  # the others, shifted past 255
    return table | {b: chr(256 + k) for k, b in enumerate(moved)}


def utf8_complete(data: bytes) -> int:
    """Length of the longest prefix of ``data`` not ending inside a UTF-8 character (only an
    incomplete trailing sequence is held back; invalid bytes are left to ``errors="replace"``)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


class TokenizerAdapter(ABC):
    """What the heterogeneous decoders need from a tokenizer."""

    name: str  # a label for messages
    vocab_size: int  # ids (the model's logits may be wider; extra ids are ignored)
    token_bytes: list[bytes | None]  # every id's bytes; None: a special (no text)
    special_names: dict[int, str]  # special id -> its text, matched across tokenizers by it
    prefix_ids: list[int]  # ids a prompt starts with (BOS), added by prompt_ids
    stop_ids: tuple[int, ...]

    @abstractmethod
    def encode_bytes(self, data: bytes) -> list[int]:
        """Ids of ``data`` without special tokens (InexpressibleTextError: it cannot)."""

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of ``ids``; special ids contribute nothing."""
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in ids if 0 <= i < len(tb))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (specials skipped; a cut UTF-8 character becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def prompt_ids(self, text: str | bytes) -> list[int]:
        """``prefix_ids`` followed by the encoding of ``text``."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return [*self.prefix_ids, *self.encode_bytes(data)]

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the byte vocabulary and the special names (the mapping cache key)."""
        digest = hashlib.sha256()
        for i, b in enumerate(self.token_bytes):
            digest.update(b"\x00N" if b is None else b"\x00B" + b)
            if i in self.special_names:
                digest.update(self.special_names[i].encode())
        return digest.hexdigest()


class CodecTokenizer(TokenizerAdapter):
    """An MTPC byte codec as a tokenizer: one id per byte, specials carry no text."""

    def __init__(self, codec: ByteCodec) -> None:
        self.codec = codec
        self.name = f"codec:{codec.name}"
        self.vocab_size = codec.vocab_size
        self.token_bytes = [
            codec.id_to_bytes(i) if codec.is_byte(i) else None for i in range(codec.vocab_size)
        ]
        self.special_names = {
            i: b.decode("utf-8", errors="replace")
            for i, b in codec.special_tokens.items()
            if not codec.is_byte(i)
        }
        self.prefix_ids = [codec.bos_id]
        self.stop_ids = tuple(codec.stop_ids)

    def encode_bytes(self, data: bytes) -> list[int]:
        return self.codec.encode(data)


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(spec: Any) -> set[str]:
    if not isinstance(spec, dict):
        return set()
    found = {str(spec.get("type"))}
    for sub in spec.get("decoders") or []:
        found |= _decoder_types(sub)
    if spec.get("type") == "Replace" and "▁" in json.dumps(spec.get("pattern")):
        found.add("Metaspace")
    return found


class HFTokenizer(TokenizerAdapter):
    """A Hugging Face fast tokenizer with byte-aware token strings: the bytes follow its
    decoder (ByteLevel: GPT-2 strings; ByteFallback: ``<0xNN>``; Metaspace / Replace: ``▁``
    is a space; otherwise the UTF-8 of the string)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.name = f"hf:{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
        self.vocab_size = len(tokenizer)
        spec = json.loads(self.backend.to_str())
        kinds = _decoder_types(spec.get("decoder"))
        added = spec.get("added_tokens") or []
        specials = {*tokenizer.all_special_ids, *(int(a["id"]) for a in added if a.get("special"))}
        strings = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        u2b = {c: b for b, c in byte_to_unicode().items()}
        self.special_names = {
            i: s for i, s in enumerate(strings) if s is not None and i in specials
        }

        def to_bytes(i: int, s: str | None) -> bytes | None:
            if s is None or i in specials:
                return None
            if "ByteFallback" in kinds and (fallback := _BYTE_FALLBACK.match(s)):
                return bytes((int(fallback.group(1), 16),))
            if "ByteLevel" in kinds and all(c in u2b for c in s):
                return bytes(u2b[c] for c in s)
            return (s.replace("▁", " ") if "Metaspace" in kinds else s).encode("utf-8")

        self.token_bytes = [to_bytes(i, s) for i, s in enumerate(strings)]
        self.prefix_ids = [int(i) for i in self.backend.encode("", add_special_tokens=True).ids]
        eos = tokenizer.eos_token_id
        self.stop_ids = () if eos is None else (int(eos),)
        self.unk_id = tokenizer.unk_token_id

    def encode_bytes(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = [int(i) for i in enc.ids]
        covered = bytearray(len(text))
        for i, (start, end) in zip(ids, enc.offsets, strict=True):
            if i == self.unk_id:
                raise InexpressibleTextError(self._cannot(text, start, "maps to the unknown token"))
            covered[start:end] = b"\x01" * (end - start)
        for pos, flag in enumerate(covered):
            if not flag and not text[pos].isspace():
                raise InexpressibleTextError(self._cannot(text, pos, "is dropped"))
        return ids

    def _cannot(self, text: str, pos: int, what: str) -> str:
        snippet = text[max(0, pos - 10) : pos + 10]
        return (
            f"tokenizer {self.name} cannot express the text: character {text[pos : pos + 1]!r} at "
            f"offset {pos} (in {snippet!r}) {what}. Heterogeneous decoding needs every target "
            "text to be expressible by the drafter (T ->> D*): use a tokenizer with byte "
            "fallback or a ByteLevel pre-tokenizer, or a byte-level drafter"
        )


_ADAPTERS: dict[int, tuple[weakref.ReferenceType[Any], TokenizerAdapter]] = {}


def as_tokenizer(obj: Any) -> TokenizerAdapter:
    """Wraps a byte codec or an HF tokenizer (cached per object; TypeError for anything
    else); adapters pass through."""
    if isinstance(obj, TokenizerAdapter):
        return obj
    hit = _ADAPTERS.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    if isinstance(obj, ByteCodec):
        adapter: TokenizerAdapter = CodecTokenizer(obj)
    elif hasattr(obj, "backend_tokenizer"):
        adapter = HFTokenizer(obj)
    else:
        raise TypeError(
            f"tokenizer is a {type(obj).__name__}; expected an MTPC ByteCodec "
            "(mtpc.get_codec(...)), a Hugging Face fast tokenizer, or a TokenizerAdapter"
        )
    with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
        _ADAPTERS[id(obj)] = (weakref.ref(obj), adapter)
    return adapter


@dataclass(frozen=True)
class VocabMapping:
    """T ∩ D by bytes (specials by text) as (target id, drafter id) pairs: a target id appears
    more than once when several drafter ids decode to the same bytes."""

    target_ids: Tensor  # (K,)
    drafter_ids: Tensor  # (K,)
    drafter_to_target: dict[int, int] = field(repr=False)
    target_size: int  # |T|: ids with bytes or a special name
    drafter_size: int  # |D|
    identical: bool  # the same vocabulary id for id (standard SD applies)

    @property
    def intersection_size(self) -> int:
        """|T ∩ D| (distinct target tokens)."""
        return len(set(self.target_ids.tolist()))

    def stats(self) -> dict[str, float]:
        """The overlap metrics of Timor et al.'s Table 5."""
        k = self.intersection_size
        return {
            "vocab_target": float(self.target_size),
            "vocab_drafter": float(self.drafter_size),
            "vocab_intersection": float(k),
            "vocab_intersection_over_target": k / max(self.target_size, 1),
        }


_MAPPINGS: dict[tuple[str, str], VocabMapping] = {}


def vocab_mapping(target_tokenizer: Any, drafter_tokenizer: Any) -> VocabMapping:
    """The byte-aware intersection of two vocabularies (cached per pair of fingerprints)."""
    t, d = as_tokenizer(target_tokenizer), as_tokenizer(drafter_tokenizer)
    key = (t.fingerprint, d.fingerprint)
    if key in _MAPPINGS:
        return _MAPPINGS[key]
    by_bytes = {b: i for i, b in reversed(list(enumerate(t.token_bytes))) if b}  # the first id
    by_name = {name: i for i, name in sorted(t.special_names.items(), reverse=True)}
    pairs: list[tuple[int, int]] = []
    for j, b in enumerate(d.token_bytes):
        hit = by_bytes.get(b) if b else by_name.get(d.special_names.get(j, "\x00"))
        if hit is not None:
            pairs.append((hit, j))
    mapping = dict((j, i) for i, j in pairs)
    t_named = [i for i, b in enumerate(t.token_bytes) if b or i in t.special_names]
    d_named = [j for j, b in enumerate(d.token_bytes) if b or j in d.special_names]
    identical = t.vocab_size == d.vocab_size and len(t_named) == len(d_named)
    identical = identical and all(mapping.get(j) == j for j in d_named)
    ids = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)  # (K, 2)
    result = VocabMapping(ids[:, 0], ids[:, 1], mapping, len(t_named), len(d_named), identical)
    _MAPPINGS[key] = result
    return result


def prompt_overlap(
    target_tokenizer: Any, drafter_tokenizer: Any, texts: Sequence[str | bytes]
) -> dict[str, float]:
    """|T' ∩ D'| / |T'|, T' (D') the target (drafter) tokens of ``texts``, compared by bytes
    (Timor et al.'s Table 6)."""
    t, d = as_tokenizer(target_tokenizer), as_tokenizer(drafter_tokenizer)
    t_used: set[bytes] = set()
    d_used: set[bytes] = set()
    for text in texts:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        for tok, used in ((t, t_used), (d, d_used)):
            used.update(filter(None, (tok.token_bytes[i] for i in tok.encode_bytes(data))))
    k = len(t_used & d_used)
    return {
        "prompt_tokens_target": float(len(t_used)),
        "prompt_tokens_intersection": float(k),
        "prompt_intersection_over_target": k / max(len(t_used), 1),
    }
