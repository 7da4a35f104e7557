"""Decoding settings checked from the settings alone, before any model loads (torch-free).

:func:`check_settings` is the one door of ``mtpc.generate``, ``mtpc.generate_hetero``,
``evaluate`` and regeneration (the same one-line refusal from each, in the caller's
:class:`Spelling`); :data:`CHAIN_RULES` maps a drafting choice onto a :class:`DraftRule`.
See docs/DECODING.md, "Drafting".
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, NoReturn

from mtpc.choices import (
    C_COMPILERS,
    COMPILE_BACKENDS,
    COMPILE_METHODS,
    DRAFTS,
    METHODS,
    POLICIES,
    PROPOSALS,
)
from mtpc.config import Refused, Rule, choice, integer, number

DEFAULT_GREEDY_DRAFT = "path"
"""Greedy draft of every family (measured: docs/DECODING.md, "The draft step")."""

DEFAULT_SAMPLING_PROPOSAL: dict[str, str] = {
    "ff": "path",
    "cp": "first_marginal",
    "hmm": "first_marginal",
    "btree": "first_marginal",
}
"""Speculative-sampling proposal per family (measured: docs/DECODING.md, "The draft step")."""


class DraftRule(StrEnum):
    """How ``speculative.draft_step`` drafts a chain and, sampling, what it verifies against.
    Internal (mapped from a drafting choice by :data:`CHAIN_RULES`); records name its value."""

    ZMAP = "zmap"  # the most probable latent path's tokens (greedy draft=path)
    MAP = "map"  # max-product over the whole (n, r, V) table (greedy draft=map)
    CHAIN = "chain"  # token by token over the whole table (greedy draft=chain)
    ZSAMPLE = "zsample"  # a drawn latent path, verified against q(. | z)
    ZSAMPLE1 = "zsample1"  # ... against the marginal at the first draft, then q(. | z)
    SAMPLE = "sample"  # ... against the marginals q(x_i | x_<i)


CHAIN_RULES: dict[tuple[str, str | None], DraftRule] = {
    ("path", None): DraftRule.ZMAP,
    ("map", None): DraftRule.MAP,
    ("chain", None): DraftRule.CHAIN,
    ("path", "path"): DraftRule.ZSAMPLE,
    ("path", "first_marginal"): DraftRule.ZSAMPLE1,
    ("path", "marginal"): DraftRule.SAMPLE,
}
"""A chain's (``draft``, ``proposal``) -> its draft rule (proposal None: greedy)."""

ALGORITHMS = ("slem", "tli", "slrs", "union", "standard")
"""Heterogeneous-vocabulary algorithms (``mtpc.generate_hetero``, docs/HETERO.md)."""
PSI_METHODS = ("auto", "enumerate", "circuit")  # how SLRS computes psi


class SettingsError(ValueError):
    """A decoding setting is not allowed (alone or with another one); the message names it."""


@dataclass(frozen=True)
class Spelling:
    """How a caller writes settings in a refusal (default: ``mtpc.generate``'s keywords):
    ``name`` maps a field to the caller's name (``evaluate``: ``drafting`` for ``draft``);
    ``config``: booleans as YAML writes them (``greedy=false``)."""

    name: Callable[[str], str] = str
    config: bool = False

    def __call__(self, field: str) -> str:
        return self.name(field)

    def eq(self, field: str, value: object) -> str:
        """``field=value`` as the caller writes it (strings quoted)."""
        text = str(value).lower() if self.config and isinstance(value, bool) else repr(value)
        return f"{self(field)}={text}"

    def refuse(self, field: str, value: object, rest: str) -> NoReturn:
        raise SettingsError(f"{self.eq(field, value)} is not allowed{rest}")


CONFIG = Spelling(lambda field: "drafting" if field == "draft" else field, config=True)
"""eval.yaml's and regenerate.yaml's spelling (``draft`` names the draft folder there)."""


def _check(spell: Spelling, field: str, value: Any, rule: Rule) -> Any:
    """``value`` if the schema's ``rule`` (``mtpc.config``) takes it; else the refusal, in the
    caller's spelling."""
    try:
        rule(field, value)
    except Refused as refused:
        spell.refuse(field, value, f"; allowed: {refused}")
    return value


def _check_tree(spell: Spelling, tree_budget: object, tree_floor: object) -> tuple[int, float]:
    """A tree's budget (0: a chain) and floor."""
    rule = integer(0, null=True, allowed="an integer >= 0 or None")
    budget = int(_check(spell, "tree_budget", tree_budget, rule) or 0)
    floor = float(_check(spell, "tree_floor", tree_floor, number(0, 1, null=False)))
    if floor and not budget:
        name, trees = spell("tree_floor"), spell("tree_budget")
        raise SettingsError(
            f"{name}={tree_floor} is not allowed without {trees}; allowed: {name}=0, or a "
            f"{trees} >= 1 (the floor prunes a tree's nodes)"
        )
    return budget, floor


def _check_draft(spell: Spelling, greedy: bool, draft: object, budget: int) -> str:
    """The draft (None: ``tree`` with a budget, else :data:`DEFAULT_GREEDY_DRAFT`)."""
    if draft is None:
        return "tree" if budget else DEFAULT_GREEDY_DRAFT
    name, trees = spell("draft"), spell("tree_budget")
    _check(spell, "draft", draft, choice(*DRAFTS))
    if draft == "tree" and not budget:
        raise SettingsError(
            f"{name}='tree' is not allowed without {trees}; allowed: {trees}=B (B >= 1 nodes "
            f"per tree), or {name}=path | map | chain"
        )
    if draft != "tree" and budget:
        allowed = f"{name}=tree (or leave {name} out), or {trees}=0 for a chain"
        spell.refuse("draft", draft, f" with {trees}={budget}; allowed: {allowed}")
    if not greedy and draft in ("map", "chain"):
        spell.refuse(
            "draft",
            draft,
            f" with {spell.eq('greedy', False)} (its drafts are not drawn from the circuit, so "
            f"speculative sampling could not be exact); allowed: {name}=path or {name}=tree",
        )
    return str(draft)


def _check_proposal(spell: Spelling, greedy: bool, draft: str, proposal: object) -> str | None:
    """The proposal as asked (None: the family's default when sampling a chain)."""
    if proposal is None:
        return None
    if greedy:
        raise SettingsError(
            f"{spell.eq('proposal', proposal)} is not allowed with {spell.eq('greedy', True)} "
            f"(greedy verifies by exact match); allowed: {spell('proposal')}=None, or "
            f"{spell.eq('greedy', False)}"
        )
    if draft == "tree":
        raise SettingsError(
            f"{spell.eq('proposal', proposal)} is not allowed with {spell('draft')}=tree (the "
            f"tree walk verifies with the target's own draws); allowed: {spell('proposal')}="
            f"None, or {spell('draft')}=path"
        )
    return str(_check(spell, "proposal", proposal, choice(*PROPOSALS)))


def check_drafting(
    greedy: bool,
    draft: object = None,
    proposal: object = None,
    tree_budget: object = None,
    tree_floor: object = 0.0,
    spell: Spelling = Spelling(),
) -> dict[str, Any]:
    """Checks a drafting choice, the same for every family (docs/DECODING.md, "Drafting");
    returns the checked ``draft``, ``proposal``, ``tree_budget`` (an int) and ``tree_floor``.
    SettingsError: an unknown value, or a setting another one would ignore or override."""
    budget, floor = _check_tree(spell, tree_budget, tree_floor)
    chosen = _check_draft(spell, greedy, draft, budget)
    asked = _check_proposal(spell, greedy, chosen, proposal)
    return {"draft": chosen, "proposal": asked, "tree_budget": budget, "tree_floor": floor}


@dataclass(frozen=True)
class DecodingSettings:
    """Decoding settings checked without a model (:func:`check_settings`): the first fields
    apply to every decoder, ``method`` .. ``tree_floor`` to ``mtpc.generate``, ``algorithm``
    .. ``psi`` to ``mtpc.generate_hetero`` (``algorithm`` None: not a heterogeneous one)."""

    max_new_tokens: int = 64
    greedy: bool = True
    seed: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] | None = None
    method: str = "speculative"
    policy: str = "condition"
    suppress_eos: bool = False
    max_throughput: bool = False
    profile: bool = False
    draft: str | None = None
    proposal: str | None = None
    tree_budget: int | None = None
    tree_floor: float = 0.0
    algorithm: str | None = None
    lookahead: int = 5
    look_behind: int = 8
    max_psi_paths: int = 4096
    psi: str = "auto"
    compile: bool | str = False  # False, or a torch.compile backend (True: inductor)

    def rule_for(self, kind: str) -> tuple[DraftRule, str | None]:
        """The draft rule for circuit family ``kind`` (a tree's: the chain it falls back to) and
        the proposal a chain verifies against (None: greedy, a tree); defaults filled in."""
        if self.greedy:
            return CHAIN_RULES["path" if self.draft == "tree" else str(self.draft), None], None
        proposal = self.proposal or DEFAULT_SAMPLING_PROPOSAL[kind]
        return CHAIN_RULES["path", proposal], None if self.draft == "tree" else proposal


def _id(name: str, value: Any) -> int:
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError, RuntimeError, ValueError):
            return operator.index(value)
    raise SettingsError(f"{name} contains {value!r}; allowed: integer token ids (not floats)")


def check_ids(name: str, items: Sequence[Any]) -> list[Any]:
    """The items, ids as ``int`` (rows of ids as lists); refuses a non-integer id instead of
    truncating it. Integer scalars (numpy, one-element integer tensors) pass."""
    return [
        [_id(name, value) for value in item] if isinstance(item, list | tuple) else _id(name, item)
        for item in items
    ]


def _check_sampling(spell: Spelling, s: DecodingSettings) -> dict[str, Any]:
    t = s.temperature
    if (
        isinstance(t, bool)
        or not isinstance(t, int | float)
        or math.isnan(t)
        or (not s.greedy and math.isinf(t))
    ):
        spell.refuse("temperature", t, "; allowed: a number > 0")
    if not s.greedy and t <= 0:
        raise SettingsError(
            f"{spell.eq('temperature', t)} is not allowed with {spell.eq('greedy', False)}; "
            f"allowed: a number > 0 (use {spell.eq('greedy', True)} for argmax decoding)"
        )
    _check(spell, "top_k", s.top_k, integer(1, null=True))
    top_p = number(0, 1, low_open=True, high_open=False, allowed="a number in (0, 1] or None")
    p = _check(spell, "top_p", s.top_p, top_p)
    return {"temperature": float(t), "top_p": None if p is None else float(p)}


def c_compiler() -> tuple[str | None, list[str]]:
    """The C compiler inductor would build with (``$CC``, else the first of
    :data:`~mtpc.choices.C_COMPILERS` on the PATH; None: none) and what was looked for."""
    cc = os.environ.get("CC")
    names = ([cc] if cc else []) + list(C_COMPILERS)
    found = next((path for name in names if (path := shutil.which(name))), None)
    return found, ([f"$CC={cc}"] if cc else []) + list(C_COMPILERS)


def check_compile(spell: Spelling, compile: object, method: str) -> bool | str:
    """``compile``: False, or the torch.compile backend it names (True: ``inductor``);
    refused with a method it does not run, or inductor without a C compiler (a token tree on
    a backbone whose engine runs chains only, EvaByte: ``static.decode_static``, with the
    model)."""
    if compile is False:
        return False
    allowed = ", ".join(repr(b) for b in COMPILE_BACKENDS)
    if compile is not True and compile not in COMPILE_BACKENDS:
        spell.refuse("compile", compile, f"; allowed: True, False, {allowed}")
    name = spell("compile")
    if method not in COMPILE_METHODS:
        raise SettingsError(
            f"{name}={compile!r} runs {' and '.join(map(repr, COMPILE_METHODS))} (not "
            f"{method!r}); allowed: {name}=False with method={method!r}"
        )
    backend = "inductor" if compile is True else str(compile)
    if backend == "inductor":
        found, looked = c_compiler()
        if found is None:
            raise SettingsError(
                f"{name}={compile!r} needs a C compiler for torch.compile's inductor backend; "
                f"looked for {', '.join(looked)} on the PATH and found none; allowed: {name}=False, or "
                f"{name}='aot_eager' (no C compiler: no speed-up)"
            )
    return backend


def check_settings(
    spell: Callable[[str], str] | Spelling | None = None, **given: Any
) -> DecodingSettings:
    """Checks ``given`` fields of :class:`DecodingSettings` (the others: defaults).

    ``spell``: a :class:`Spelling`, or a function of a field's name, for the messages. With
    an ``algorithm`` (heterogeneous decoding) ``max_new_tokens`` may be 0 and the drafting
    fields are not checked. SettingsError: one line naming the field and the allowed values;
    TypeError: an unknown field.
    """
    sp = spell if isinstance(spell, Spelling) else Spelling(spell or str)
    s = DecodingSettings(**given)
    hetero = s.algorithm is not None
    if not hetero:
        _check(sp, "method", s.method, choice(*METHODS))
    _check(sp, "max_new_tokens", s.max_new_tokens, integer(0 if hetero else 1))
    _check(sp, "seed", s.seed, integer(0))
    if not hetero:
        _check(sp, "policy", s.policy, choice(*POLICIES))
    if not isinstance(s.greedy, bool):
        sp.refuse("greedy", s.greedy, "; allowed: True, False")
    drafting = {} if hetero else check_drafting(
        s.greedy, s.draft, s.proposal, s.tree_budget, s.tree_floor, sp
    )  # fmt: skip
    sampling = _check_sampling(sp, s)
    stops = None if s.stop_ids is None else tuple(check_ids(sp("stop_ids"), list(s.stop_ids)))
    compile = False if hetero else check_compile(sp, s.compile, s.method)
    if hetero:
        _check(sp, "algorithm", s.algorithm, choice(*ALGORITHMS))
        _check(sp, "psi", s.psi, choice(*PSI_METHODS))
        _check(sp, "lookahead", s.lookahead, integer(1))
        _check(sp, "look_behind", s.look_behind, integer(0))
        _check(sp, "max_psi_paths", s.max_psi_paths, integer(1))
    flags: dict[str, Any] = {
        name: bool(getattr(s, name)) for name in ("suppress_eos", "max_throughput", "profile")
    }
    return replace(s, **drafting, **sampling, **flags, stop_ids=stops, compile=compile)
