"""The byte-level Llama 3.2 3B Instruct (``benjamin/Llama3-2-3B-IT-Byte``, tokenkit), whose
*expansion embedding* reads the id history (the longest recent run found in
``expand_input_ids_dict``). See docs/BACKBONES.md, "The byte Llama's input expansion"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mtpc.backbones.llama import LlamaBackbone

HUB_ID = "benjamin/Llama3-2-3B-IT-Byte"
HOST_RULE_MAX_POSITIONS = 16
"""Up to this many positions of a CPU tensor, the Python rule beats the trie walk's fixed
torch overhead (0.01 ms against 0.3 ms for one id)."""


def expand_input_ids(
    ids: torch.Tensor,
    expand_dict: tuple[Mapping[tuple[int, ...], int], set[int]],
    maxlen: int,
    last_n: int | None = None,
) -> torch.Tensor:
    """Expanded ids of every position of ``ids`` (B, S) -> (B, S) (zeros before ``S - last_n``).
    ``expand_dict = (table, singles)``: ``table`` maps a tuple of shifted ids (id + 1, most recent
    first) to an expanded id + 1; ``singles`` are shifted ids that map on their own. The longest
    suffix of the history (up to ``maxlen`` ids) found in ``table`` wins."""
    table, singles = expand_dict
    out = torch.zeros_like(ids)
    first = 0 if last_n is None else max(0, ids.shape[1] - last_n)
    for b, row in enumerate(ids.tolist()):
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


class ExpansionLookup:
    """tokenkit's expansion rule (:func:`expand_input_ids`), vectorised over positions. The
    table's keys form a trie: node ``u``'s child by shifted id ``x`` is the sorted edge key
    ``u * K + x`` (K = the largest id in a key + 1). Every position walks it with its history,
    one depth per ``searchsorted`` step, keeping the deepest node that is a key."""

    def __init__(self, expand_dict: tuple[Mapping[tuple[int, ...], int], set[int]], maxlen: int):
        if maxlen < 1:
            raise ValueError(f"expand_input_ids_maxlen is {maxlen}; allowed: an integer >= 1")
        table, singles = expand_dict
        edges: dict[int, int] = {}
        # a history holds shifted ids >= 1 and at most maxlen of them: other keys never match
        keys = [key for key in table if 0 < len(key) <= maxlen and min(key) >= 1]
        width = max((max(key) for key in keys), default=0) + 1  # K
        values, is_key, depth = [0], [False], 0
        for key in keys:
            node = 0
            for x in key:
                edge = node * width + x
                child = edges.get(edge)
                if child is None:
                    child = edges[edge] = len(values)
                    values.append(0)
                    is_key.append(False)
                node = child
            values[node], is_key[node] = table[key] - 1, True
            depth = max(depth, len(key))
        self.dead = len(values)  # a node without children: a walk that found no edge
        values.append(0)
        is_key.append(False)
        order = sorted(edges) or [-1]  # -1: no edge matches (an empty table)
        self.width, self.depth = width, depth  # depth <= maxlen: longer keys were left out
        self.edges = torch.tensor(order, dtype=torch.long)  # (E,) sorted edge keys
        self.children = torch.tensor([edges.get(e, self.dead) for e in order])  # (E,)
        self.values = torch.tensor(values, dtype=torch.long)  # (N + 1,) expanded id of a key
        self.is_key = torch.tensor(is_key, dtype=torch.bool)  # (N + 1,)
        single = [x for x in singles if x >= 1]  # a history never holds shifted id 0
        size = max(single, default=-1) + 2  # + 1: ids past every single
        self.single = torch.zeros(size, dtype=torch.bool)  # (S,) shifted id -> in singles
        self.single_value = torch.zeros(size, dtype=torch.long)  # (S,) its own entry
        for x in single:
            self.single[x], self.single_value[x] = True, table[(x,)] - 1
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:
            own = (self.edges, self.children, self.values, self.is_key)
            self._on[device] = tuple(t.to(device) for t in (*own, self.single, self.single_value))
        return self._on[device]

    def __call__(self, ids: torch.Tensor, last_n: int | None = None) -> torch.Tensor:
        """Expanded ids of ``ids`` (B, S) -> (B, S), zeros before ``S - last_n`` (as the rule)."""
        b, s = ids.shape
        first = 0 if last_n is None else max(0, s - last_n)
        out = torch.zeros_like(ids)
        if first >= s:
            return out
        x = ids.long() + 1  # (B, S) shifted ids
        d = self.depth
        padded = torch.cat([x.new_zeros(b, d), x], dim=1)  # (B, d + S): 0 before the row
        # cols[:, p, j]: the shifted id j steps before position first + p (0 before the row)
        steps = torch.arange(d, device=ids.device)  # (d,)
        back = torch.arange(first + d, s + d, device=ids.device)[:, None] - steps  # (P, d)
        out[:, first:] = self.walk(padded[:, back], ids.device.type == "cpu").to(out.dtype)
        return out

    def walk(self, cols: torch.Tensor, early: bool = False) -> torch.Tensor:
        """Expanded ids (B, P) of positions whose shifted histories are ``cols`` (B, P, m)
        (``cols[..., j]``: the shifted id j steps back, 0 before the row; ``m`` >= the trie's
        depth). ``early``: stop once no walk goes on (a host sync: CPU, uncompiled, only)."""
        edges, children, values, is_key, single, single_value = self._tensors(cols.device)
        cols = torch.where(cols < self.width, cols, 0)  # 0: an id no key holds
        node = torch.zeros_like(cols[..., 0])  # (B, P) trie node
        best = torch.zeros_like(node)  # (B, P): the deepest key's value (0: no key matched)
        for j in range(self.depth):
            edge = node * self.width + cols[..., j]  # (B, P)
            at = torch.searchsorted(edges, edge).clamp_(max=edges.numel() - 1)  # (B, P)
            node = torch.where(edges[at] == edge, children[at], self.dead)
            best = torch.where(is_key[node], values[node], best)
            if early and bool((node == self.dead).all()):
                break
        last = cols[..., 0].clamp(max=single.numel() - 1)  # (B, P) the most recent shifted id
        return torch.where(single[last], single_value[last], best)


class Llama3ByteBackbone(LlamaBackbone):
    """``TPULlamaForCausalLM`` with the expansion embedding; bytes are ids 0-255."""

    needs_history = True

    def __init__(self, hf_model: nn.Module, source: dict[str, Any] | None = None) -> None:
        super().__init__(hf_model, name="llama3_byte", codec="llama3_byte", source=source)
        config: Any = hf_model.config
        self.expand = bool(getattr(config, "expand_input_ids", False))
        self.maxlen = int(getattr(config, "expand_input_ids_maxlen", 0) or 0)
        self._lookup: ExpansionLookup | None = None  # built on the first expansion

    def expand_ids(self, history: torch.Tensor, last_n: int | None = None) -> torch.Tensor:
        """Expanded ids of ``history`` (B, S) -> (B, S) (zeros before ``S - last_n``): the trie
        walk, or the Python rule for at most :data:`HOST_RULE_MAX_POSITIONS` on the CPU."""
        positions = history.shape[1] if last_n is None else min(last_n, history.shape[1])
        if history.device.type == "cpu" and positions <= HOST_RULE_MAX_POSITIONS:
            return expand_input_ids(history, self.inner.expand_input_ids_dict, self.maxlen, last_n)
        lookup = self.expansion(history.device)
        assert lookup is not None
        return lookup(history, last_n)

    def expansion(self, device: torch.device) -> ExpansionLookup | None:
        """The expansion's trie (None: no expansion), its tables on ``device``."""
        if not self.expand:
            return None
        if self._lookup is None:
            self._lookup = ExpansionLookup(self.inner.expand_input_ids_dict, self.maxlen)
        self._lookup._tensors(device)
        return self._lookup

    def embed_windows(self, ids: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Input embeddings (B, T, d) of ``ids`` (B, T) whose shifted histories (id + 1, most
        recent first, the id itself at 0, 0 before the row) are ``windows`` (B, T, maxlen): tensor
        ops only, no host sync (the compiled static decode step's)."""
        emb = self.inner.embed_tokens(ids)  # (B, T, d)
        lookup = self.expansion(ids.device)
        if lookup is None:
            return emb
        return emb + self.inner.expand_embed_tokens(lookup.walk(windows))

    def embed(self, ids: torch.Tensor, past_ids: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.inner.embed_tokens(ids)  # (B, T, d)
        if not self.expand:
            return emb
        t = ids.shape[1]
        history = ids if past_ids is None else torch.cat([past_ids, ids], dim=1)  # (B, P + T)
        history = history[:, -(t + self.maxlen - 1) :]  # only maxlen - 1 past ids can matter
        expanded = self.expand_ids(history, last_n=t)[:, -t:]  # (B, T): the new positions only
        return emb + self.inner.expand_embed_tokens(expanded)


def load_llama3_byte(
    path: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> Llama3ByteBackbone:
    """Loads the byte-level Llama (remote code) and checks it (TargetLoadError)."""
    from mtpc.backbones.remote_code import load_remote_causal_lm
    from mtpc.backbones.sanity import check_target

    path = path or HUB_ID
    hf_model = load_remote_causal_lm("llama3_byte", path, revision, dtype, device)
    source = {"model": "llama3_byte", "path": path, "revision": revision}
    backbone = Llama3ByteBackbone(hf_model, source=source)
    check_target(backbone, f"model=llama3_byte (path={path!r})")
    return backbone
