"""Lossless speculative decoding across heterogeneous vocabularies (Timor et al., 2025):
``generate_hetero`` with ``standard``, ``union``, ``tli``, ``slem`` and ``slrs`` (Alg. 5, 1, 4,
2, 3), verified by :mod:`mtpc.decoding.verify`'s rules (docs/HETERO.md, "Algorithms")."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from mtpc.backbones.compat import (
    CacheInterfaceError,
    cache_guard_message,
    cache_keyword,
    output_cache,
)
from mtpc.decoding.common import GenerationResult, Stopwatch, TargetRule, cut_at_stop
from mtpc.decoding.settings import check_settings
from mtpc.decoding.verify import verify_greedy, verify_sampling
from mtpc.decoding.vocab import (
    CodecTokenizer,
    HeteroVocabularyError,
    InexpressibleTextError,
    TokenizerAdapter,
    as_tokenizer,
    utf8_complete,
    vocab_mapping,
)

_BOTTOM = -1  # a proposal outside the target vocabulary (always rejected)


class PsiBoundError(RuntimeError):
    """The psi enumeration of SLRS needs more drafter paths than ``max_psi_paths``."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id sequences (what a cache reuses)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class CachedLM:
    """An HF causal LM with a KV cache that follows a token sequence (reusing the common prefix
    with the last call). Models whose output has no cache (stubs) are re-run on the whole
    sequence; a cache that does not grow by what a pass fed it is refused."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = list(model.parameters()) if hasattr(model, "parameters") else []
        self.device = params[0].device if params else torch.device("cpu")
        self.ids: list[int] = []
        self.cache: Any = None
        self.passes = 0
        self.cache_kw = cache_keyword(type(model), default="past_key_values")

    @torch.no_grad()
    def logits(self, seq: Sequence[int], rows: int = 1) -> Tensor:
        """Next-token logits after ``seq[:len-rows+1]``, ..., after ``seq``; (rows, V) float."""
        seq = list(seq)
        if not 1 <= rows <= len(seq):
            raise ValueError(f"rows must be in 1..{len(seq)}, got {rows}")
        start = min(_common_prefix(self.ids, seq), len(seq) - rows) if self.cache is not None else 0
        if start and len(self.ids) > start:
            self.cache.crop(-(len(self.ids) - start))
        inp = torch.tensor([seq[start:]], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=inp, use_cache=True, **{self.cache_kw: self.cache if start else None}
        )
        self.cache = output_cache(out)
        if self.cache is not None and hasattr(self.cache, "get_seq_length"):
            got = int(self.cache.get_seq_length())
            if got != len(seq):
                raise CacheInterfaceError(
                    cache_guard_message(self.model, self.cache_kw, len(seq), got)
                )
        self.ids = seq
        self.passes += 1
        return out.logits[0, -rows:].float()


class CircuitDrafter:
    """A byte-level MTPCModel as an SLRS drafter: exact conditionals and prefix marginals
    (``tokenizer``: the codec adapter of its vocabulary)."""

    def __init__(self, model: Any, tokenizer: TokenizerAdapter) -> None:
        if not isinstance(tokenizer, CodecTokenizer):
            raise HeteroVocabularyError(
                "an MTPCModel drafter needs its byte codec as drafter_tokenizer "
                f"(mtpc.get_codec(...)), got {tokenizer.name}"
            )
        self.model = model
        self.window = int(model.head.circuit.window)
        self.offset = tokenizer.codec.byte_offset  # a byte's id is its value + offset
        self.device = next(model.head.parameters()).device
        self.caches = model.new_caches()
        self.ids: list[int] = []
        self.params: Any = None
        self.passes = 0

    @torch.no_grad()
    def condition(self, seq: Sequence[int]) -> None:
        """Runs the trunk (and draft tail) on ``seq``, reusing the cached common prefix."""
        seq = list(seq)
        start = min(_common_prefix(self.ids, seq), len(seq) - 1)
        self.caches.crop(start)
        ids = torch.tensor([seq[start:]], dtype=torch.long, device=self.device)
        hidden = self.model.trunk(ids, self.caches.trunk)  # (1, T, d)
        if self.model.k:
            hidden = self.model.draft_tail(hidden, self.caches.draft)
        self.params = self.model.draft_params(hidden[:, -1])  # batch 1
        self.ids = seq
        self.passes += 1

    @torch.no_grad()
    def dist(self, path: Sequence[int]) -> Tensor:
        """q(x_{m+1} | context, path) over the vocabulary; (V,)."""
        prefix = torch.tensor([list(path)], dtype=torch.long, device=self.device) if path else None
        return self.model.head.circuit.conditional_log_prob(self.params, prefix)[0].exp().float()

    @torch.no_grad()
    def prefix_probs(self, strings: Sequence[bytes]) -> Tensor:
        """q(window starts with s) for each byte string s (1 <= len <= window); (K,)."""
        n = self.window
        last = torch.tensor([len(s) - 1 for s in strings], device=self.device)  # (K,)
        mask = torch.arange(n, device=self.device) <= last[:, None]  # (K, n)
        padded = [[b + self.offset for b in s.ljust(n, b"\0")] for s in strings]  # masked: unread
        x = torch.tensor(padded, dtype=torch.long, device=self.device)  # (K, n)
        lp = self.model.head.circuit.prefix_log_prob(self.params.expand(len(strings)), x, mask)
        return lp.gather(1, last[:, None])[:, 0].exp().double().cpu()  # (K,)


def _is_mtpc(model: Any) -> bool:
    return hasattr(model, "draft_params") and hasattr(model, "head")


class _Session:
    """One decoding run: target context, generated bytes, drafter context, and the decision
    rule of the target (and of an HF drafter) with its generator."""

    def __init__(
        self,
        target: Any,
        t_tok: TokenizerAdapter,
        drafter: Any,
        d_tok: TokenizerAdapter,
        prompt_ids: list[int],
        rule: TargetRule,
        generator: torch.Generator,
    ) -> None:
        self.t_tok, self.d_tok = t_tok, d_tok
        self.rule, self.generator = rule, generator
        self.tlm = CachedLM(target)
        self.circuit = CircuitDrafter(drafter, d_tok) if _is_mtpc(drafter) else None
        self.dlm = None if self.circuit is not None else CachedLM(drafter)
        self.ctx = list(prompt_ids)
        self.data = bytearray(t_tok.decode_bytes(prompt_ids))

    def drafter_context(self) -> tuple[list[int], bytes]:
        """Drafter ids of the text so far and the bytes held back (a cut UTF-8 character)."""
        data = bytes(self.data)
        cut = len(data) if isinstance(self.d_tok, CodecTokenizer) else utf8_complete(data)
        try:
            ids = [*self.d_tok.prefix_ids, *self.d_tok.encode_bytes(data[:cut])]
        except InexpressibleTextError as err:
            raise InexpressibleTextError(f"the drafter's {err}") from None
        return ids, data[cut:]

    def drafter_logits(self, seq: Sequence[int]) -> Tensor:
        assert self.dlm is not None
        return self.dlm.logits(seq, 1)[0]


def to_target_tokens(
    t_tok: TokenizerAdapter, context: Sequence[int], draft: bytes, look_behind: int = 8
) -> list[int]:
    """Target tokens continuing ``context`` with the bytes ``draft`` (SLEM line 7; the
    look-behind alignment: docs/HETERO.md, "Algorithms"); [] when it cannot be expressed."""
    if not draft:
        return []
    with contextlib.suppress(InexpressibleTextError):
        if isinstance(t_tok, CodecTokenizer):
            return t_tok.encode_bytes(draft)
        window = list(context[-look_behind:]) if look_behind > 0 else []
        specials = [i for i, t in enumerate(window) if t_tok.token_bytes[t] is None]
        if specials:
            window = window[specials[-1] + 1 :]
        for k in range(len(window), -1, -1):
            tail = window[len(window) - k :]
            data = t_tok.decode_bytes(tail) + draft
            data = data[: utf8_complete(data)]
            if len(data) <= len(t_tok.decode_bytes(tail)):
                return []
            new = t_tok.encode_bytes(data)
            if new[:k] == tail:
                return new[k:]
    return []


def _slem_cycle(sess: _Session, lookahead: int, look_behind: int) -> tuple[list[int], int]:
    """One SLEM cycle (Alg. 2): the new target tokens and the drafts accepted."""
    rule, g = sess.rule, sess.generator
    d_ids, pending = sess.drafter_context()
    path: list[int] = []
    draft = b""
    for _ in range(lookahead):
        tok = rule.pick(sess.drafter_logits(d_ids + path), g)
        piece = sess.d_tok.token_bytes[tok] if tok < len(sess.d_tok.token_bytes) else None
        if not piece:  # a special (end of text) ends the draft
            break
        path.append(tok)
        draft += piece
    if pending:
        draft = draft[len(pending) :] if draft.startswith(pending) else b""
    cands = to_target_tokens(sess.t_tok, sess.ctx, draft, look_behind)
    rows = sess.tlm.logits(sess.ctx + cands, len(cands) + 1)  # (m + 1, V)
    choice = rule.choose(rows, g)  # (m + 1,) the target's own choices
    verdict = verify_greedy(choice, torch.tensor(cands, dtype=torch.long))
    return [*cands[: verdict.accepted], verdict.next_token], verdict.accepted


def _token_cycle(sess: _Session, algorithm: str, lookahead: int) -> tuple[list[int], int]:
    """One ``standard``, ``union`` or ``tli`` cycle (Alg. 5, 1, 4), as :func:`_slem_cycle`."""
    rule, g = sess.rule, sess.generator
    mapping = vocab_mapping(sess.t_tok, sess.d_tok)
    d_ids, pending = (list(sess.ctx), b"") if algorithm == "standard" else sess.drafter_context()
    drafts: list[int] = []  # target ids (or _BOTTOM)
    rows_q: list[tuple[Tensor, float]] = []  # (probs of mapping's pairs, bottom mass)
    path: list[int] = []
    mapped_d, mapped_t = mapping.drafter_ids, mapping.target_ids
    union = algorithm == "union"  # else drafts from T ∩ D only (tli, standard)
    for _ in range(0 if pending else lookahead):
        logits = sess.drafter_logits(d_ids + path)[: len(sess.d_tok.token_bytes)]  # (V_D,)
        if rule.greedy:
            d = int(rule.argmax(logits) if union else mapped_d[rule.argmax(logits[mapped_d])])
        else:
            q = rule.probs(logits)  # (V_D,)
            sub = q[mapped_d]  # (K,)
            mass = float(sub.sum())
            if union:  # the mass outside T is ⊥'s
                d = rule.sample(q, g)
                rows_q.append((sub, max(0.0, 1.0 - mass)))
            elif mass > 0:  # renormalised over T ∩ D
                sub = sub / mass
                d = int(mapped_d[rule.sample(sub, g)])
                rows_q.append((sub, 0.0))
            else:
                break
        t = mapping.drafter_to_target.get(d, _BOTTOM)
        drafts.append(t)
        if t == _BOTTOM:
            break
        path.append(d)

    def draft_probs(vocab: int) -> Tensor:
        q = torch.zeros(len(drafts), vocab + 1, dtype=torch.float32)  # rule.probs' dtype
        for j, (probs, rest) in enumerate(rows_q):
            q[j].index_add_(0, mapped_t, probs)
            q[j, vocab] = rest
        return q

    bottom = _BOTTOM in drafts
    return _verify(sess, drafts[:-1] if bottom else drafts, bottom, draft_probs)


def _verify(
    sess: _Session, real: list[int], bottom: bool, draft_probs: Callable[[int], Tensor]
) -> tuple[list[int], int]:
    """Verifies the target-id drafts ``real``, then ⊥ if ``bottom`` (always rejected);
    ``draft_probs(V)``: the q they were drawn from, ``(n, V + 1)``, asked when sampling."""
    rule = sess.rule
    rows = sess.tlm.logits(sess.ctx + real, len(real) + 1)  # (m + 1, V)
    vocab = rows.shape[-1]
    draft = torch.tensor([*real, vocab] if bottom else real, dtype=torch.long)
    if bottom:  # a row for after ⊥, never read: ⊥ is always rejected
        rows = torch.cat([rows, rows[-1:]])
    if rule.greedy:
        verdict = verify_greedy(rule.argmax(rows), draft)
    else:
        q = draft_probs(vocab)
        p = torch.nn.functional.pad(rule.probs(rows), (0, 1)).to(q.dtype)  # over T ∪ {⊥}
        verdict = verify_sampling(p, q, draft, sess.generator)
    return [*real[: verdict.accepted], verdict.next_token], verdict.accepted


@dataclass
class SLRSTable:
    """Eligible target tokens for SLRS proposals (non-special, 1..max_len bytes)."""

    ids: dict[bytes, int]  # bytes -> target id
    # proper prefixes of eligible tokens (b"" included): a longer token may still match
    strict_prefixes: set[bytes]
    # target id -> its minimal eligible extensions (their prefix events are disjoint)
    extensions: dict[int, list[int]]
    max_len: int  # the longest eligible token

    @classmethod
    def build(cls, t_tok: TokenizerAdapter, max_len: int) -> SLRSTable:
        ids: dict[bytes, int] = {}
        for i, b in enumerate(t_tok.token_bytes):
            if b and len(b) <= max_len and b not in ids:
                ids[b] = i
        prefixes = {b[:k] for b in ids for k in range(len(b))}
        ext: dict[int, list[int]] = {i: [] for i in ids.values()}
        for b, i in ids.items():
            parent = next((ids[b[:k]] for k in range(len(b) - 1, 0, -1) if b[:k] in ids), None)
            if parent is not None:
                ext[parent].append(i)
        return cls(ids, prefixes, ext, max((len(b) for b in ids), default=0))

    def determined(self, drafted: bytes, pending: bytes) -> bool:
        """Whether the first target token of ``pending + ...`` is fixed by ``drafted``."""
        if len(drafted) < len(pending):
            return not pending.startswith(drafted)
        if not drafted.startswith(pending):
            return True
        return drafted[len(pending) :] not in self.strict_prefixes

    def propose(self, drafted: bytes, pending: bytes) -> int:
        """The longest eligible target token prefixing the drafted text, or ⊥ (-1)."""
        if not drafted.startswith(pending):
            return _BOTTOM
        rest = drafted[len(pending) :]
        for k in range(min(self.max_len, len(rest)), 0, -1):
            hit = self.ids.get(rest[:k])
            if hit is not None:
                return hit
        return _BOTTOM

    def psi(self, q: dict[int, float], vocab: int) -> Tensor:
        """psi(t) = q(t) - sum of q(t') over minimal extensions; (vocab,) float64."""
        out = torch.zeros(vocab, dtype=torch.float64)
        for i, qi in q.items():
            out[i] = qi - sum(q[j] for j in self.extensions[i])
        return out.clamp(min=0.0)


def _prefix_upper(r: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with ``r``."""
    r = r.rstrip(b"\xff")
    return r[:-1] + bytes((r[-1] + 1,)) if r else None


class PathEnumerator:
    """Prefix probabilities Q(b) of a drafter's byte stream by enumerating token paths
    (docs/HETERO.md, "SLRS"); ``dist``: path -> q(. | context, path) ``(V_D,)``, one drafter
    pass per path prefix, memoised, at most ``max_paths`` (then :class:`PsiBoundError`)."""

    def __init__(
        self,
        dist: Callable[[tuple[int, ...]], Tensor],
        token_bytes: Sequence[bytes | None],
        max_paths: int,
    ) -> None:
        self.dist_fn, self.max_paths = dist, max_paths
        pairs = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        self.keys = [b for b, _ in pairs]
        self.order = torch.tensor([i for _, i in pairs], dtype=torch.long)
        self.by_bytes: dict[bytes, list[int]] = {}
        for b, i in pairs:
            self.by_bytes.setdefault(b, []).append(i)
        self.memo: dict[tuple[int, ...], Tensor] = {}

    def dist(self, path: tuple[int, ...], label: bytes = b"") -> Tensor:
        if path not in self.memo:
            if len(self.memo) >= self.max_paths:
                raise PsiBoundError(
                    f"SLRS psi enumeration for target token {label!r} needs more than "
                    f"max_psi_paths={self.max_paths} drafter paths (the count grows as "
                    "2^(m-1) in the token length m): lower lookahead, raise max_psi_paths, "
                    "or use a byte-level MTPC drafter (psi='circuit', exact from prefix "
                    "marginals)"
                )
            self.memo[path] = self.dist_fn(path).double()
        return self.memo[path]

    def prefix_probs(self, strings: Sequence[bytes]) -> list[float]:
        """Q(b) for each b in ``strings`` (non-empty)."""
        out = [0.0] * len(strings)

        def walk(path: tuple[int, ...], spelled: bytes, weight: float, todo: list[int]) -> None:
            q = self.dist(path, strings[todo[0]])
            cum = torch.cat([q.new_zeros(1), q[self.order].cumsum(0)])  # (N + 1,)
            children: dict[int, tuple[bytes, list[int]]] = {}
            for idx in todo:
                rest = strings[idx][len(spelled) :]
                lo = bisect.bisect_left(self.keys, rest)
                upper = _prefix_upper(rest)
                hi = len(self.keys) if upper is None else bisect.bisect_left(self.keys, upper)
                out[idx] += weight * float(cum[hi] - cum[lo])
                for k in range(1, len(rest)):
                    for d in self.by_bytes.get(rest[:k], ()):
                        children.setdefault(d, (rest[:k], []))[1].append(idx)
            for d, (piece, sub) in children.items():
                w = float(q[d])
                if w > 0:
                    walk((*path, d), spelled + piece, weight * w, sub)

        walk((), b"", 1.0, list(range(len(strings))))
        return out


def _slrs_cycle(
    sess: _Session, table: SLRSTable, psi_method: str, max_psi_paths: int
) -> tuple[list[int], int]:
    """One SLRS cycle (Alg. 3), as :func:`_slem_cycle`."""
    rule, g = sess.rule, sess.generator
    circuit = sess.circuit
    d_tb = sess.d_tok.token_bytes
    d_ids, pending = sess.drafter_context()
    if circuit is not None:
        circuit.condition(d_ids)

    def dist(path: tuple[int, ...]) -> Tensor:
        if circuit is not None:
            return circuit.dist(path)
        logits = sess.drafter_logits(d_ids + list(path))[: len(d_tb)]
        if rule.greedy:
            return torch.nn.functional.one_hot(rule.argmax(logits), len(d_tb)).double()
        return rule.probs(logits)

    enum = PathEnumerator(dist, d_tb, max_psi_paths)
    limit = table.max_len + len(pending) if circuit is None else circuit.window
    path: tuple[int, ...] = ()
    drafted = b""
    while len(path) < limit and not table.determined(drafted, pending):
        q = enum.dist(path)
        tok = int(q.argmax()) if rule.greedy else rule.sample(q, g)
        piece = d_tb[tok] if tok < len(d_tb) else None
        if not piece:  # a special ends the drafted text
            break
        path, drafted = (*path, tok), drafted + piece
    proposal = table.propose(drafted, pending)

    def draft_probs(vocab: int) -> Tensor:
        psi = slrs_psi(table, sess, enum, pending, vocab, psi_method)  # (V,)
        return torch.cat([psi, (1.0 - psi.sum()).clamp(min=0.0).reshape(1)])[None]  # (1, V + 1)

    bottom = proposal == _BOTTOM
    return _verify(sess, [] if bottom else [proposal], bottom, draft_probs)


def slrs_psi(
    table: SLRSTable, sess: _Session, enum: PathEnumerator, pending: bytes, vocab: int, method: str
) -> Tensor:
    """psi over the target vocabulary, (vocab,) float64 (mass left over is ⊥)."""
    strings = [pending + b for b in table.ids]
    if method == "circuit":
        assert sess.circuit is not None  # generate_hetero's psi check
        values = sess.circuit.prefix_probs(strings).tolist()
    else:
        values = enum.prefix_probs(strings)
    return table.psi(dict(zip(table.ids.values(), values, strict=True)), vocab)


def generate_hetero(
    target: Any,
    target_tokenizer: Any,
    drafter: Any,
    drafter_tokenizer: Any,
    prompt: str | Sequence[int],
    algorithm: str = "slem",
    lookahead: int = 5,
    greedy: bool = True,
    seed: int = 0,
    max_new_tokens: int = 64,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    look_behind: int = 8,
    max_psi_paths: int = 4096,
    psi: str = "auto",
    stop_ids: Sequence[int] | None = None,
) -> GenerationResult:
    """Lossless speculative decoding with a drafter of another vocabulary. The arguments, the
    result (``method="hetero"``) and the errors: docs/HETERO.md, "API" and "Errors".
    ``drafter``: an HF causal LM, or an MTPCModel on a byte-level backbone (``slrs`` only);
    ``prompt``: text (BOS added) or target ids; ``lookahead``: drafter tokens per cycle, for
    ``slrs`` the longest target token (in bytes) that can be proposed."""
    checked = check_settings(  # model-free: the same refusals as mtpc.generate and evaluate
        algorithm=algorithm, lookahead=lookahead, greedy=greedy, seed=seed,
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        look_behind=look_behind, max_psi_paths=max_psi_paths, psi=psi,
        stop_ids=None if stop_ids is None else tuple(stop_ids),
    )  # fmt: skip
    t_tok, d_tok = as_tokenizer(target_tokenizer), as_tokenizer(drafter_tokenizer)
    prompt_ids = t_tok.prompt_ids(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not prompt_ids:
        raise ValueError("prompt is empty: give text or at least one target id (e.g. BOS)")
    psi = _psi_method(drafter, algorithm, psi)
    _check_vocabularies(t_tok, d_tok, algorithm)
    rule = TargetRule(greedy, checked.temperature, top_k, checked.top_p, sample_dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    sess = _Session(target, t_tok, drafter, d_tok, prompt_ids, rule, generator)
    stops = set(t_tok.stop_ids if checked.stop_ids is None else checked.stop_ids)
    if sess.circuit is not None:
        lookahead = min(lookahead, sess.circuit.window)
    if algorithm == "slem":
        cycle = partial(_slem_cycle, sess, lookahead, look_behind)
    elif algorithm == "slrs":
        table = SLRSTable.build(t_tok, lookahead)
        if not table.ids:
            raise HeteroVocabularyError(f"target {t_tok.name} has no token of 1..{lookahead} bytes")
        cycle = partial(_slrs_cycle, sess, table, psi, max_psi_paths)
    else:
        cycle = partial(_token_cycle, sess, algorithm, lookahead)
    res = GenerationResult(tokens=[], method="hetero", algorithm=algorithm)
    clock = Stopwatch(sess.tlm.device, profile=False)
    while len(res.tokens) < max_new_tokens:
        new, acc = cycle()
        new, res.stopped = cut_at_stop(new, max_new_tokens - len(res.tokens), stops)
        res.accepted.append(min(acc, len(new)))
        res.emitted.append(len(new))
        res.tokens.extend(new)
        sess.ctx.extend(new)
        sess.data += t_tok.decode_bytes(new)
        res.cycle_seconds.append(clock.split())
        if res.stopped:
            break
    res.seconds = sum(res.cycle_seconds)
    res.text = sess.t_tok.decode(res.tokens)
    res.target_passes = sess.tlm.passes
    res.drafter_passes = (sess.circuit or sess.dlm).passes  # type: ignore[union-attr]
    return res


def _psi_method(drafter: Any, algorithm: str, psi: str) -> str:
    """SLRS's psi for this drafter (``auto``: ``circuit`` for an MTPCModel, else ``enumerate``)."""
    if _is_mtpc(drafter):
        if algorithm != "slrs":
            raise ValueError(
                f"an MTPCModel drafter works with algorithm='slrs' (psi from the circuit's "
                f"prefix marginals), not {algorithm!r}; pass an HF causal LM for the others"
            )
        return "circuit" if psi == "auto" else psi
    if psi == "circuit":
        raise ValueError("psi='circuit' needs an MTPCModel drafter; use psi='enumerate'")
    return "enumerate"


def _check_vocabularies(t_tok: TokenizerAdapter, d_tok: TokenizerAdapter, algorithm: str) -> None:
    """TLI needs T ∩ D; ``standard`` needs one vocabulary, id for id."""
    if algorithm not in ("tli", "union", "standard"):
        return
    mapping = vocab_mapping(t_tok, d_tok)
    if algorithm == "tli" and mapping.intersection_size == 0:
        raise HeteroVocabularyError(
            f"T ∩ D is empty for target {t_tok.name} and drafter {d_tok.name} (no token "
            "decodes to the same bytes): TLI can never accept a draft. Use "
            "algorithm='slem' (string-level exact match needs no shared tokens)"
        )
    if algorithm == "standard" and not mapping.identical:
        raise HeteroVocabularyError(
            f"algorithm='standard' needs the drafter to share the target's vocabulary id "
            f"for id; {t_tok.name} and {d_tok.name} differ (|T ∩ D| = "
            f"{mapping.intersection_size}). Use 'tli' or 'slem'"
        )
