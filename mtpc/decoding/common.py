"""What the decoders share: the result, the model-dependent request check, the target's
decision rule (applied identically by every decoder, so speculative output equals
autoregressive output), the stop rule and the cycle stopwatch. See docs/DECODING.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.engine import inverse_cdf
from mtpc.decoding.settings import DecodingSettings, DraftRule, check_ids
from mtpc.decoding.verify import process_logits

SECTIONS = ("model", "head", "circuit", "verify", "cache")
"""Breakdown sections of a cycle; the rest of its wall time is reported as ``overhead``."""


@dataclass
class GenerationResult:
    """Output of one prompt's decoding (``mtpc.generate``, ``mtpc.generate_hetero``).

    ``emitted``: tokens appended per cycle (``accepted`` + the kept correction / bonus; the
    last cycle may be cut short), sums to ``len(tokens)``. ``drafted``: drafts verified per
    cycle (n, or n - 1 when the window's first position is the pending token, given as
    evidence; a tree's deepest node's depth). ``cycle_seconds``, ``prefill_seconds``:
    synchronised wall times; many prompts at once, the row's share of each batch cycle, so
    the rows' seconds add up to the call's wall time. ``expected`` (token trees): per cycle,
    the circuit's probability that at least d drafts are accepted, d = 1..depth (the sum of
    q over the depth-d nodes).
    """

    tokens: list[int]  # the new ids (<= max_new_tokens), ending with a stop id if one came
    accepted: list[int] = field(default_factory=list)  # drafts accepted per cycle (AR: 0)
    emitted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # first verified window position
    cycle_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # prefill + cycles
    trunk_passes: int = 0  # after the prefill: one per cycle, plus one per recompute
    stopped: bool = False  # a stop id ended the generation
    method: str = "speculative"  # | autoregressive | hetero
    policy: str | None = None
    draft_rule: str | None = None  # a DraftRule value, or tree<B>
    draft: str | None = None
    proposal: str | None = None  # None when greedy or for trees
    breakdown: dict[str, float] | None = None  # profile: seconds per section + overhead
    nodes: list[int] = field(default_factory=list)  # token trees: nodes verified per cycle
    expected: list[list[float]] = field(default_factory=list)
    text: str = ""  # mtpc.generate_hetero's: the tokens' text (specials skipped)
    target_passes: int = 0  # hetero: prefill included
    drafter_passes: int = 0  # hetero: psi enumeration included
    algorithm: str | None = None  # hetero's (ar: the evaluation's reference)
    engine: str = "eager"  # | compiled | static (compile=True's caches run eagerly: a fallback)

    @property
    def num_cycles(self) -> int:
        return len(self.cycle_seconds)


@dataclass(frozen=True)
class Request(DecodingSettings):
    """Decoding settings checked for a model (:func:`check_request`): the drafting choice
    resolved for the head's circuit family (``proposal`` None: greedy or a tree;
    ``tree_budget`` 0: a chain, always autoregressive), the stop ids filled in."""

    draft: str = "path"
    proposal: str | None = None
    tree_budget: int = 0
    stop_ids: tuple[int, ...] = ()
    draft_rule: DraftRule = DraftRule.ZMAP


def context_length(model: Any) -> int | None:
    """The target's context (``max_position_embeddings``), or None when it has none."""
    value = getattr(model.backbone.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def default_stop_ids(model: Any) -> tuple[int, ...]:
    """The stop ids of the target's byte codec (end of turn, eos); without one, its
    ``generation_config`` (else ``config``) ``eos_token_id``, as ``transformers``; or ()."""
    from mtpc.backbones.codecs import get_codec

    backbone = model.backbone
    codec = getattr(backbone, "codec", None)
    if codec is not None:
        with contextlib.suppress(ValueError, KeyError):
            return tuple(get_codec(codec).stop_ids)
    generation = getattr(getattr(backbone, "hf_model", None), "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(backbone, "config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))


def prompt_tensor(model: Any, prompt_ids: Any, name: str = "prompt_ids") -> Tensor:
    """A prompt (list of ids, (T,) or (1, T) tensor) as a (1, T) long tensor on the device;
    ValueError for an empty one, B > 1 rows, non-integer ids (never truncated), ids >= V."""
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError(
                f"{name} is a {str(prompt_ids.dtype).removeprefix('torch.')} tensor; "
                "allowed: integer token ids (an int64 tensor or a list of ints)"
            )
        ids = prompt_ids.detach().to("cpu", torch.long)
    else:
        bad = f"{name} must be a list of ints or a 1-D / (1, T) tensor; got {prompt_ids!r:.80}"
        try:
            items = list(prompt_ids)
        except TypeError as err:
            raise ValueError(bad) from err
        check_ids(name, items)  # SettingsError is a ValueError
        try:
            ids = torch.tensor(items, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(bad) from err
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)}; allowed: (T,) or (1, T) (one prompt; "
            "a list of prompts for many)"
        )
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty; allowed: at least one token id")
    vocab = model.backbone.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} contains id {lo if lo < 0 else hi}; allowed: 0..{vocab - 1}")
    return ids[None].to(model.backbone.device)


def check_request(model: Any, prompt: Tensor, settings: DecodingSettings) -> Request:
    """Completes ``check_settings`` with what needs the model: a draft head for
    ``speculative``, the family's drafting defaults, stop ids below the vocabulary, the prompt
    and the new tokens within the context. ValueError naming the argument."""
    s = settings
    speculative = s.method == "speculative"
    if speculative and not hasattr(model, "head"):
        raise ValueError("method='speculative' needs an MTPCModel with a draft head")
    rule, proposal = s.rule_for(model.head.circuit.kind if speculative else "ff")
    vocab = model.backbone.vocab_size
    stops = default_stop_ids(model) if s.stop_ids is None else s.stop_ids
    bad = [t for t in stops if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_ids contains {bad[0]}; allowed: ids in 0..{vocab - 1}")
    if s.suppress_eos and len(stops) >= vocab:
        raise ValueError("suppress_eos=True would suppress every token; pass fewer stop_ids")
    context = context_length(model)
    length = prompt.shape[1]
    if context is not None:
        if length >= context:
            raise ValueError(
                f"the prompt has {length} tokens but the target's context is {context}; "
                f"allowed: at most {context - 1} prompt tokens"
            )
        lookahead = model.head.circuit.window if speculative else 0
        if length + s.max_new_tokens + lookahead > context:
            raise ValueError(
                f"prompt ({length}) + max_new_tokens ({s.max_new_tokens})"
                + (f" + window ({lookahead})" if lookahead else "")
                + f" exceeds the target's context ({context}); allowed: max_new_tokens <= "
                f"{max(0, context - length - lookahead)}"
            )
    resolved = {"stop_ids": stops, "draft_rule": rule, "proposal": proposal}
    return Request(**{**vars(s), **resolved, "tree_budget": s.tree_budget if speculative else 0})


@dataclass(frozen=True, eq=False)
class TargetRule:
    """The target's decision rule, shared by every decoder (heterogeneous ones included):
    argmax, or sampling ``process_logits`` (temperature, top-k, top-p)."""

    greedy: bool
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    suppress: Tensor | None = None  # (S,) ids set to -inf first (suppress_eos, paper App. F)
    sample_dtype: torch.dtype = torch.float32  # what draws read (hetero: float64, its draws)

    @classmethod
    def of(cls, request: Request, device: torch.device) -> TargetRule:
        """The rule of a checked request (stop ids suppressed with ``suppress_eos``)."""
        suppress = None
        if request.suppress_eos and request.stop_ids:
            suppress = torch.tensor(request.stop_ids, device=device)
        return cls(request.greedy, request.temperature, request.top_k, request.top_p, suppress)

    def _masked(self, logits: Tensor) -> Tensor:
        if self.suppress is None:
            return logits
        return logits.index_fill(-1, self.suppress, float("-inf"))

    def argmax(self, logits: Tensor) -> Tensor:
        """Greedy choices (...,) of logits (..., V)."""
        return self._masked(logits).argmax(-1)

    def probs(self, logits: Tensor) -> Tensor:
        """Sampling distributions (..., V) in fp32."""
        return process_logits(self._masked(logits), self.temperature, self.top_k, self.top_p).exp()

    def sample(self, probs: Tensor, generator: torch.Generator | None) -> int:
        """One draw from a distribution (V,)."""
        return int(torch.multinomial(probs.to(self.sample_dtype), 1, generator=generator))

    def pick(self, logits: Tensor, generator: torch.Generator | None) -> int:
        """One next token from logits (V,): argmax or a sample."""
        if self.greedy:
            return int(self.argmax(logits))
        return self.sample(self.probs(logits), generator)

    def draw(self, logits: Tensor, u: Tensor | None) -> Tensor:
        """One next token per row of logits ``(..., V)``: argmaxes, or samples by inverse CDF
        with the uniforms ``u`` ``(...,)`` (a row's stream, ``mtpc.decoding.draws``)."""
        if self.greedy:
            return self.argmax(logits)
        assert u is not None, "sampling needs uniforms"
        return inverse_cdf(self.probs(logits), u)

    def choose(self, logits: Tensor, generator: torch.Generator | None) -> Tensor:
        """One token per row of logits (k, V): argmaxes or one draw per row (k,)."""
        if self.greedy:
            return self.argmax(logits)
        probs = self.probs(logits).to(self.sample_dtype)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


class Stopwatch:
    """Synchronised wall time. ``lap(section)`` charges the time since the last lap to
    ``section`` (profiling only: then every lap synchronises); ``split()`` ends a cycle and
    returns its wall time (always synchronised)."""

    def __init__(self, device: torch.device, profile: bool) -> None:
        self.device = device
        self.profile = profile
        self.sections: dict[str, float] = dict.fromkeys(SECTIONS, 0.0)
        self.total = 0.0
        self._start = self._last = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, section: str) -> None:
        if self.profile:
            t = self.now()
            self.sections[section] += t - self._last
            self._last = t

    def split(self) -> float:
        t = self.now()
        elapsed = t - self._start
        self._start = self._last = t
        return elapsed

    def breakdown(self, cycles: float) -> dict[str, float] | None:
        """Section totals plus ``overhead`` (the rest of ``cycles`` seconds)."""
        if not self.profile:
            return None
        out = dict(self.sections)
        out["overhead"] = max(0.0, cycles - sum(out.values()))
        return out


def cut_at_stop(
    new: Sequence[int], room: int, stop_ids: Sequence[int] | set[int], ignore_stops: bool = False
) -> tuple[list[int], bool]:
    """The stop rule of every decoder: the first ``room`` ids of ``new``, cut after the first
    stop id unless ``ignore_stops``, and whether a stop id ended them."""
    kept = list(new[: max(room, 0)])
    if stop_ids and not ignore_stops:
        for i, tok in enumerate(kept):
            if tok in stop_ids:
                return kept[: i + 1], True
    return kept, False
