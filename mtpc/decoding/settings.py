"""Decoding settings checked from the settings alone, before any model loads.

The drafting vocabulary (docs/DECODING.md, "Drafting", is the one table of the choices):

* ``draft``: what a cycle drafts: ``path`` (the latent path), ``map``, ``chain``, or ``tree``
  (a token tree of ``tree_budget`` nodes);
* ``proposal`` (sampling with a ``path`` draft): what speculative sampling verifies the
  drafts against: ``path`` (q(. | z)), ``first_marginal`` (the marginal at the first draft,
  then q(. | z)) or ``marginal``.

:func:`check_settings` checks every setting a decoding call can be refused on without a
model (method, greedy, seed, policy, the drafting choice (:func:`check_drafting`: a setting
another one would silently ignore or override is refused), sampling, stop ids' integer-ness,
max_new_tokens, the heterogeneous decoder's algorithm and lookahead, ...) into one
:class:`DecodingSettings`; ``mtpc.generate``, ``mtpc.generate_hetero``, ``evaluate`` and
regeneration all refuse through it, so a bad setting gets the same one-line message from
each, in the caller's :class:`Spelling`. Once the circuit family is known, one table
(:data:`CHAIN_RULES`, :meth:`DecodingSettings.rule_for`) maps the checked choice onto the
draft step's internal :class:`DraftRule`, with the family's measured defaults. What needs
the model (prompt ids in range, prompt vs context length, stop ids below the vocabulary) is
checked at decode time (``mtpc.decoding.common.check_request``).

This module is torch-free: evaluation configs are checked with it before anything loads.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mtpc.choices import DRAFTS, METHODS, POLICIES, PROPOSALS

DEFAULT_GREEDY_DRAFT = "path"
"""Greedy draft of every family (measured, docs/BENCHMARKS.md "Latent-path drafts"): the most
probable latent path reads n - 1 rows of W and runs no circuit pass; ``map`` accepts
0.07-0.34 drafts per cycle more at a dearer cycle. For ff every draft gives the same tokens."""

DEFAULT_SAMPLING_PROPOSAL: dict[str, str] = {
    "ff": "path",
    "cp": "first_marginal",
    "hmm": "first_marginal",
    "btree": "first_marginal",
}
"""Speculative-sampling proposal per family (measured, docs/BENCHMARKS.md). For ff the
proposals coincide (one unit) and ``path`` reads the fewest rows; ``first_marginal`` accepts at
least as much as ``path`` (Jensen) for the rows of one position, read only when asked."""


class DraftRule(StrEnum):
    """How the draft step (``mtpc.decoding.speculative.draft_step``) drafts a chain and, when
    sampling, what its drafts are verified against. Internal: a drafting choice maps onto it
    by :data:`CHAIN_RULES`; results and records name it by its value."""

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
PSI_METHODS = ("auto", "enumerate", "circuit")
"""How SLRS computes psi (``mtpc.generate_hetero``'s ``psi``)."""


class SettingsError(ValueError):
    """A decoding setting is not allowed (alone or with another one); the message names it."""


def _same(field: str) -> str:
    return field


@dataclass(frozen=True)
class Spelling:
    """How a caller writes settings in a refusal (default: ``mtpc.generate``'s keywords).

    Attributes:
        name: the caller's name of a field (``evaluate``: ``drafting`` for ``draft``,
            ``drafter.lookahead`` for ``lookahead``).
        config: booleans as a YAML config writes them (``greedy=false``).
    """

    name: Callable[[str], str] = _same
    config: bool = False

    def __call__(self, field: str) -> str:
        return self.name(field)

    def eq(self, field: str, value: object) -> str:
        """``field=value`` as the caller writes it (strings quoted)."""
        text = str(value).lower() if self.config and isinstance(value, bool) else repr(value)
        return f"{self(field)}={text}"


CONFIG = Spelling(lambda field: "drafting" if field == "draft" else field, config=True)
"""The spelling of eval.yaml and regenerate.yaml, where ``draft`` names the exported draft
folder and the chain's draft is ``drafting``."""


def _choice(spell: Spelling, field: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SettingsError(
            f"{spell.eq(field, value)} is not allowed; allowed: {', '.join(allowed)}"
        )
    return str(value)


def _integer(spell: Spelling, field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(
            f"{spell.eq(field, value)} is not allowed; allowed: an integer >= {minimum}"
        )
    return value


def _check_tree(spell: Spelling, tree_budget: object, tree_floor: object) -> tuple[int, float]:
    """A tree's budget (0: a chain) and floor."""
    if (
        isinstance(tree_budget, bool)
        or not isinstance(tree_budget, int | None)
        or (tree_budget is not None and tree_budget < 0)
    ):
        raise SettingsError(
            f"{spell.eq('tree_budget', tree_budget)} is not allowed; allowed: an integer >= 0 or "
            "None"
        )
    if (
        isinstance(tree_floor, bool)
        or not isinstance(tree_floor, int | float)
        or not 0 <= tree_floor < 1
    ):
        raise SettingsError(
            f"{spell.eq('tree_floor', tree_floor)} is not allowed; allowed: a number in [0, 1)"
        )
    floor, budget = spell("tree_floor"), spell("tree_budget")
    if tree_floor and not tree_budget:
        raise SettingsError(
            f"{floor}={tree_floor} is not allowed without {budget}; allowed: {floor}=0, or a "
            f"{budget} >= 1 (the floor prunes a tree's nodes)"
        )
    return tree_budget or 0, float(tree_floor)


def _check_draft(spell: Spelling, greedy: bool, draft: object, budget: int) -> str:
    """The draft (None: ``tree`` with a budget, else :data:`DEFAULT_GREEDY_DRAFT`)."""
    if draft is None:
        return "tree" if budget else DEFAULT_GREEDY_DRAFT
    name, trees = spell("draft"), spell("tree_budget")
    _choice(spell, "draft", draft, DRAFTS)
    if draft == "tree" and not budget:
        raise SettingsError(
            f"{name}='tree' is not allowed without {trees}; allowed: {trees}=B (B >= 1 nodes "
            f"per tree), or {name}=path | map | chain"
        )
    if draft != "tree" and budget:
        raise SettingsError(
            f"{spell.eq('draft', draft)} is not allowed with {trees}={budget}; allowed: "
            f"{name}=tree (or leave {name} out), or {trees}=0 for a chain"
        )
    if not greedy and draft in ("map", "chain"):
        raise SettingsError(
            f"{spell.eq('draft', draft)} is not allowed with {spell.eq('greedy', False)} (its "
            "drafts are not drawn from the circuit, so speculative sampling could not be exact); "
            f"allowed: {name}=path or {name}=tree"
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
    return _choice(spell, "proposal", proposal, PROPOSALS)


def check_drafting(
    greedy: bool,
    draft: object = None,
    proposal: object = None,
    tree_budget: object = None,
    tree_floor: object = 0.0,
    spell: Spelling = Spelling(),
) -> dict[str, Any]:
    """Checks a drafting choice (docs/DECODING.md, Drafting); the same refusals for every
    circuit family (the family fills its defaults later: :meth:`DecodingSettings.rule_for`).

    Args:
        greedy: greedy decoding (exact match) or speculative sampling.
        draft: ``path`` | ``map`` | ``chain`` | ``tree``; None: ``tree`` with a
            ``tree_budget``, else ``path``.
        proposal: sampling a chain only: ``path`` | ``first_marginal`` | ``marginal``; None:
            the family's default (:data:`DEFAULT_SAMPLING_PROPOSAL`).
        tree_budget: nodes per tree (``draft=tree``); 0 or None: no tree.
        tree_floor: tree nodes with q(path) below it are left out; needs a budget.
        spell: how the caller names the fields.

    Returns:
        The checked ``draft``, ``proposal``, ``tree_budget`` (an int) and ``tree_floor``.

    Raises:
        SettingsError: an unknown value, or a setting another one would ignore or override.
    """
    budget, floor = _check_tree(spell, tree_budget, tree_floor)
    chosen = _check_draft(spell, greedy, draft, budget)
    asked = _check_proposal(spell, greedy, chosen, proposal)
    return {"draft": chosen, "proposal": asked, "tree_budget": budget, "tree_floor": floor}


@dataclass(frozen=True)
class DecodingSettings:
    """Decoding settings checked without a model (:func:`check_settings`).

    The shared fields apply to every decoder; ``method`` .. ``tree_floor`` to ``mtpc.generate``
    (the drafting choice checked by :func:`check_drafting`: ``proposal`` None is the family's
    default, :meth:`rule_for` fills it); ``algorithm`` .. ``psi`` to ``mtpc.generate_hetero``
    (``algorithm`` None: not a heterogeneous decoding).
    """

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

    def rule_for(self, kind: str) -> tuple[DraftRule, str | None]:
        """The draft rule of the checked drafting choice for circuit family ``kind`` (a tree's:
        the chain it falls back to) and the proposal a chain's drafts are verified against
        (None: greedy, or a tree); where none was asked for, the family's measured default."""
        if self.greedy:
            return CHAIN_RULES["path" if self.draft == "tree" else str(self.draft), None], None
        proposal = self.proposal or DEFAULT_SAMPLING_PROPOSAL[kind]
        return CHAIN_RULES["path", proposal], None if self.draft == "tree" else proposal


def check_ids(name: str, items: Sequence[Any]) -> list[Any]:
    """Refuses a float (or any non-integer) id instead of truncating it; one level of nesting
    (rows of ids) allowed. Integer scalars (numpy, one-element integer tensors) pass.

    Returns:
        The items, ids as ``int`` (rows as lists).
    """
    out: list[Any] = []
    for item in items:
        nested = isinstance(item, list | tuple)
        row = []
        for value in item if nested else [item]:
            try:
                if isinstance(value, bool):
                    raise TypeError
                row.append(operator.index(value))
            except (TypeError, RuntimeError, ValueError):
                raise SettingsError(
                    f"{name} contains {value!r}; allowed: integer token ids (not floats)"
                ) from None
        out.append(row if nested else row[0])
    return out


def _check_sampling(spell: Spelling, s: DecodingSettings) -> dict[str, Any]:
    """Temperature, top-k and top-p."""
    t = s.temperature
    if (
        isinstance(t, bool)
        or not isinstance(t, int | float)
        or math.isnan(t)
        or (not s.greedy and math.isinf(t))
    ):
        raise SettingsError(f"{spell.eq('temperature', t)} is not allowed; allowed: a number > 0")
    if not s.greedy and t <= 0:
        raise SettingsError(
            f"{spell.eq('temperature', t)} is not allowed with {spell.eq('greedy', False)}; "
            f"allowed: a number > 0 (use {spell.eq('greedy', True)} for argmax decoding)"
        )
    if s.top_k is not None:
        _integer(spell, "top_k", s.top_k, 1)
    p = s.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1):
        raise SettingsError(
            f"{spell.eq('top_p', p)} is not allowed; allowed: a number in (0, 1] or None"
        )
    return {"temperature": float(t), "top_p": None if p is None else float(p)}


def check_settings(
    spell: Callable[[str], str] | Spelling | None = None, **given: Any
) -> DecodingSettings:
    """Checks decoding settings from the settings alone, before any model loads.

    Args:
        spell: how the caller names the fields in messages (a :class:`Spelling`, or a function
            of the field's name: ``evaluate``'s ``drafter.lookahead``); None: their own names.
        **given: fields of :class:`DecodingSettings`; the others keep their defaults.
            ``algorithm`` given (not None): a heterogeneous decoding (``max_new_tokens`` may
            be 0; the drafting fields are not checked).

    Returns:
        The checked settings.

    Raises:
        SettingsError: one line naming the field and the allowed values.
        TypeError: an unknown field.
    """
    sp = spell if isinstance(spell, Spelling) else Spelling(spell or _same)
    s = DecodingSettings(**given)
    hetero = s.algorithm is not None
    if not hetero:
        _choice(sp, "method", s.method, METHODS)
    _integer(sp, "max_new_tokens", s.max_new_tokens, 0 if hetero else 1)
    _integer(sp, "seed", s.seed, 0)
    if not hetero:
        _choice(sp, "policy", s.policy, POLICIES)
    if not isinstance(s.greedy, bool):
        raise SettingsError(f"{sp.eq('greedy', s.greedy)} is not allowed; allowed: True, False")
    drafting = {} if hetero else check_drafting(
        s.greedy, s.draft, s.proposal, s.tree_budget, s.tree_floor, sp
    )  # fmt: skip
    sampling = _check_sampling(sp, s)
    stops = None if s.stop_ids is None else tuple(check_ids(sp("stop_ids"), list(s.stop_ids)))
    if hetero:
        _choice(sp, "algorithm", s.algorithm, ALGORITHMS)
        _choice(sp, "psi", s.psi, PSI_METHODS)
        _integer(sp, "lookahead", s.lookahead, 1)
        _integer(sp, "look_behind", s.look_behind, 0)
        _integer(sp, "max_psi_paths", s.max_psi_paths, 1)
    return DecodingSettings(
        **{
            **given,
            **drafting,
            **sampling,
            "stop_ids": stops,
            "suppress_eos": bool(s.suppress_eos),
            "max_throughput": bool(s.max_throughput),
            "profile": bool(s.profile),
        }
    )
