"""Byte codecs: byte ids, special ids and chat templates (ids + assistant mask) of the byte
targets: ``evabyte`` (also the tiny target; byte ``b`` is id ``b + 64``; its template always
opens with a system block) and ``llama3_byte`` (byte ``b`` is id ``b``, then the Llama 3
template's tokens). Sources: docs/BACKBONES.md, "The real configs"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatEncoding:
    """A conversation rendered by a chat template: ``ids`` and ``assistant_mask``, True on the
    bytes of every assistant message and the end-of-turn id that closes it."""

    ids: list[int]
    assistant_mask: list[bool]


class ByteCodec(ABC):
    """Maps text to byte ids and back, and renders chat templates."""

    name: str
    vocab_size: int
    byte_offset: int
    pad_id: int
    bos_id: int
    eos_id: int
    eot_id: int
    special_tokens: Mapping[int, bytes]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn during generation."""
        return (self.eot_id, self.eos_id)

    def encode(self, text: str | bytes) -> list[int]:
        """Encodes text (UTF-8) or raw bytes as byte ids, without special tokens."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        offset = self.byte_offset
        return [b + offset for b in data]

    def is_byte(self, token_id: int) -> bool:
        return self.byte_offset <= token_id < self.byte_offset + 256

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a special token's text for specials)."""
        if self.is_byte(token_id):
            return bytes((token_id - self.byte_offset,))
        if token_id in self.special_tokens:
            return self.special_tokens[token_id]
        raise ValueError(
            f"token_id {token_id} is outside the {self.name} vocabulary (0..{self.vocab_size - 1})"
        )

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        """Concatenates the bytes of ``ids``; special ids are dropped when ``skip_special``."""
        out = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if self.is_byte(token_id):
                out.append(token_id - self.byte_offset)
            elif not skip_special:
                out += self.id_to_bytes(token_id)
            elif not 0 <= token_id < self.vocab_size:
                self.id_to_bytes(token_id)  # raises with the vocabulary range
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Decodes ids to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
    ) -> ChatEncoding:
        """Renders ``messages`` ([{role, content}]) with the target's chat template (ValueError:
        an unknown role or non-string content)."""
        for index, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ValueError(f"messages[{index}].role is {role!r}; allowed: {ROLES}")
            if not isinstance(content, str):
                raise ValueError(
                    f"messages[{index}].content must be a string, got {type(content).__name__}"
                )
        if self.opens_with_system and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": ""}, *messages]
        ids: list[int] = []
        mask: list[bool] = []

        def put(new_ids: list[int], flag: bool) -> None:
            ids.extend(new_ids)
            mask.extend([flag] * len(new_ids))

        put([self.bos_id], False)
        for message in messages:
            put(self._header(message["role"]), False)
            put([*self.encode(message["content"]), self.eot_id], message["role"] == "assistant")
        if add_generation_prompt:
            put(self._header("assistant"), False)
        return ChatEncoding(ids, mask)

    def generation_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Ids of a conversation followed by the assistant header, ready for generation."""
        return self.apply_chat_template(messages, add_generation_prompt=True).ids

    opens_with_system = False  # the template always opens with a system block (empty: none given)

    @abstractmethod
    def _header(self, role: str) -> list[int]:
        """Ids that open a turn of ``role``."""


class EvaByteCodec(ByteCodec):
    """EvaByte's layout: 64 specials, then the 256 bytes (also the tiny target's)."""

    name = "evabyte"
    vocab_size = 320
    byte_offset = 64
    pad_id, bos_id, eos_id = 0, 1, 2
    start_header_id, end_header_id, eot_id = 9, 10, 11
    special_tokens: Mapping[int, bytes] = {
        0: b"<pad>", 1: b"<bos>", 2: b"<eos>", 3: b"<unk>", 4: b"<sep>", 5: b"<repo_name>",
        6: b"<file_sep>", 7: b"<t2v_token>", 8: b"<v2t_token>", 9: b"<|start_header_id|>",
        10: b"<|end_header_id|>", 11: b"<|eot_id|>",
        **{i: f"<extra_id_{i}>".encode() for i in range(12, 64)},
    }  # fmt: skip
    opens_with_system = True

    def _header(self, role: str) -> list[int]:
        return [self.start_header_id, *self.encode(role), self.end_header_id, *self.encode("\n\n")]


class Llama3ByteCodec(ByteCodec):
    """The byte-level Llama 3.2 layout (tokenkit's byte conversion)."""

    name = "llama3_byte"
    vocab_size = 265
    byte_offset = 0
    bos_id, end_header_id, eos_id, eot_id, start_header_id = 256, 257, 258, 259, 260
    pad_id = eos_id  # tokenkit maps <pad> to <|end_of_text|>
    role_ids: Mapping[str, int] = {"assistant": 261, "system": 262, "user": 263}
    double_newline_id = 264
    special_tokens: Mapping[int, bytes] = {
        256: b"<|begin_of_text|>", 257: b"<|end_header_id|>", 258: b"<|end_of_text|>",
        259: b"<|eot_id|>", 260: b"<|start_header_id|>", 261: b"assistant", 262: b"system",
        263: b"user", 264: b"\n\n",
    }  # fmt: skip

    def _header(self, role: str) -> list[int]:
        return [
            self.start_header_id,
            self.role_ids[role],
            self.end_header_id,
            self.double_newline_id,
        ]


CODECS: dict[str, type[ByteCodec]] = {
    "evabyte": EvaByteCodec,
    "tiny": EvaByteCodec,
    "llama3_byte": Llama3ByteCodec,
}


def get_codec(name: str) -> ByteCodec:
    """Returns the codec called ``name`` (``evabyte``, ``tiny`` or ``llama3_byte``)."""
    if name not in CODECS:
        raise ValueError(f"codec is {name!r}; allowed: {sorted(CODECS)}")
    return CODECS[name]()
