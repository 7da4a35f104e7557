"""The byte-level Llama 3.2 3B Instruct (``benjamin/Llama3-2-3B-IT-Byte``, tokenkit).

Its remote code (tokenkit ``TPULlamaForCausalLM``) adds an *expansion embedding* to the
byte embeddings: for every position, the longest run of recent ids (most recent first, at
most ``config.expand_input_ids_maxlen`` of them) found in ``expand_input_ids_dict`` picks a
row of ``model.expand_embed_tokens``. The embedding of a position therefore depends on the
ids before it, so :meth:`Llama3ByteBackbone.embed` needs the id history (``past_ids``), and
the trunk's :class:`~mtpc.backbones.base.LayerCache` records it.

The lookup is the remote module's own ``torch_expand_input_ids`` when the module has one;
otherwise :func:`expand_input_ids`, which implements the same rule.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mtpc.backbones.llama import LlamaBackbone

HUB_ID = "benjamin/Llama3-2-3B-IT-Byte"


def expand_input_ids(
    ids: torch.Tensor,
    expand_dict: tuple[Mapping[tuple[int, ...], int], set[int]],
    maxlen: int,
    last_n: int | None = None,
) -> torch.Tensor:
    """Expanded ids of every position of ``ids`` (B, S) -> (B, S) (zeros before ``S - last_n``).

    ``expand_dict = (table, singles)``: ``table`` maps a tuple of shifted ids (id + 1, most
    recent first) to an expanded id + 1; ``singles`` are shifted ids that map on their own.
    The longest suffix of the history (up to ``maxlen`` ids) found in ``table`` wins.
    """
    table, singles = expand_dict
    out = torch.zeros_like(ids)
    rows = ids.tolist()
    first = 0 if last_n is None else max(0, ids.shape[1] - last_n)
    for b, row in enumerate(rows):
        for i in range(first, len(row)):
            recent = tuple(x + 1 for x in reversed(row[max(0, i - maxlen + 1) : i + 1]))
            if recent[0] in singles:
                out[b, i] = table[recent[:1]] - 1
                continue
            for n in range(len(recent), 0, -1):
                hit = table.get(recent[:n])
                if hit is not None:
                    out[b, i] = hit - 1
                    break
    return out


class Llama3ByteBackbone(LlamaBackbone):
    """``TPULlamaForCausalLM`` with the expansion embedding; bytes are ids 0-255."""

    needs_history = True

    def __init__(self, hf_model: nn.Module, source: dict[str, Any] | None = None) -> None:
        super().__init__(hf_model, name="llama3_byte", codec="llama3_byte", source=source)
        config: Any = hf_model.config
        self.expand = bool(getattr(config, "expand_input_ids", False))
        self.maxlen = int(getattr(config, "expand_input_ids_maxlen", 0) or 0)
        module = sys.modules.get(type(self.inner).__module__)
        remote = getattr(module, "torch_expand_input_ids", None)
        self._expand_fn: Callable[..., torch.Tensor] = remote or expand_input_ids

    def embed(self, ids: torch.Tensor, past_ids: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.inner.embed_tokens(ids)  # (B, T, d)
        if not self.expand:
            return emb
        t = ids.shape[1]
        history = ids if past_ids is None else torch.cat([past_ids, ids], dim=1)  # (B, P + T)
        if self.maxlen > 0:  # only the last maxlen - 1 past ids can matter
            history = history[:, -(t + self.maxlen - 1) :]
        expanded = self._expand_fn(
            history.cpu(), self.inner.expand_input_ids_dict, self.maxlen, last_n=t
        )[:, -t:].to(ids.device)  # (B, T)
        return emb + self.inner.expand_embed_tokens(expanded)

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.hf_model(input_ids=ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[..., : self.vocab_size]


def load_llama3_byte(
    path: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> Llama3ByteBackbone:
    """Loads the byte-level Llama (remote code) from the hub or a local checkpoint and checks it.

    Raises:
        TargetLoadError: the checkpoint cannot be loaded or fails the load-time check.
    """
    from mtpc.backbones.compat import load_remote_causal_lm
    from mtpc.backbones.sanity import check_target

    path = path or HUB_ID
    hf_model = load_remote_causal_lm("llama3_byte", path, revision, dtype, device)
    source = {"model": "llama3_byte", "path": path, "revision": revision}
    backbone = Llama3ByteBackbone(hf_model, source=source)
    check_target(backbone, f"model=llama3_byte (path={path!r})")
    return backbone
