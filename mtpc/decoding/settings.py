"""Decoding settings checked from the settings alone, before any model loads.

The drafting vocabulary (docs/DECODING.md, "Drafting", is the one table of the choices):

* ``draft``: what a cycle drafts: ``path`` (the latent path), ``map``, ``chain``, or ``tree``
  (a token tree of ``tree_budget`` nodes);
* ``proposal`` (sampling with a ``path`` draft): what speculative sampling verifies the
  drafts against: ``path`` (q(. | z)), ``first_marginal`` (the marginal at the first draft,
  then q(. | z)) or ``marginal``.

:func:`resolve_drafting` maps a choice onto the draft step's internal mode
(``mtpc.decoding.speculative.draft_step``), fills the measured per-family defaults and refuses,
in one line naming the fields, any setting another one would silently ignore or override.
The old ``draft_mode`` names keep working for one release, each with a one-line note of what
it is now.

:func:`check_settings` checks every other setting a decoding call can be refused on without a
model (method, greedy, seed, policy, sampling, stop ids' integer-ness, max_new_tokens, the
heterogeneous decoder's algorithm and lookahead, ...) into one :class:`DecodingSettings`;
``mtpc.generate``, ``mtpc.generate_hetero`` and ``evaluate`` all refuse through it, so a bad
setting gets the same one-line message from each. What needs the model (prompt ids in range,
prompt vs context length, stop ids below the vocabulary) is checked at decode time
(``mtpc.decoding.common.check_request``).

This module is torch-free: evaluation configs are checked with it before anything loads.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mtpc.choices import CIRCUIT_KINDS, DRAFT_MODES, DRAFTS, METHODS, POLICIES, PROPOSALS

_log = logging.getLogger(__name__)
_NOTED: set[tuple[str, bool]] = set()

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

GREEDY_MODES = {"path": "zmap", "map": "map", "chain": "chain"}
"""Greedy ``draft`` -> the draft step's mode."""
SAMPLING_MODES = {"path": "zsample", "first_marginal": "zsample1", "marginal": "sample"}
"""Sampling ``proposal`` (``draft=path``) -> the draft step's mode."""

LEGACY_DRAFT_MODES: dict[str, tuple[str, str | None]] = {
    "zmap": ("path", None),
    "map": ("map", None),
    "chain": ("chain", None),
    "zsample": ("path", "path"),
    "zsample1": ("path", "first_marginal"),
    "sample": ("path", "marginal"),
}
"""The old ``draft_mode`` names (kept for one release) -> (draft, proposal)."""
SAMPLED_MODES = ("sample", "zsample", "zsample1")
"""Internal modes whose drafts are drawn from the circuit (speculative sampling needs one)."""


class SettingsError(ValueError):
    """A decoding setting is not allowed (alone or with another one); the message names it."""


@dataclass(frozen=True)
class Drafting:
    """A checked drafting choice.

    Attributes:
        draft: ``path`` | ``map`` | ``chain`` | ``tree``.
        proposal: sampling with a chain draft: ``path`` | ``first_marginal`` | ``marginal``;
            None when greedy or for a tree (whose walk verifies with the target's draws).
        mode: the draft step's internal mode (a tree's: the chain it falls back to on a
            backbone without tree attention).
        tree_budget: nodes per tree (0: a chain).
        tree_floor: leave out tree nodes with q(path) below it.
    """

    draft: str
    proposal: str | None
    mode: str
    tree_budget: int = 0
    tree_floor: float = 0.0


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SettingsError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")
    return str(value)


def legacy_note(draft_mode: str, greedy: bool) -> str:
    """The one-line note an old ``draft_mode`` name logs: what it is now (a greedy-only name
    with ``greedy=False`` is refused before any note)."""
    draft, proposal = LEGACY_DRAFT_MODES[draft_mode]
    if greedy and proposal is not None:
        return (
            f"draft_mode={draft_mode} with greedy=True drafts a drawn latent path (no new name; "
            "draft=path drafts the most probable one); see docs/DECODING.md, Drafting"
        )
    new = f"draft={draft}" + (f" proposal={proposal}" if proposal else "")
    return f"draft_mode={draft_mode} is {new}; draft_mode is deprecated"


def resolve_drafting(
    kind: str,
    greedy: bool,
    *,
    draft: str | None = None,
    proposal: str | None = None,
    draft_mode: str | None = None,
    tree_budget: int | None = None,
    tree_floor: float = 0.0,
) -> Drafting:
    """Checks a drafting choice and maps it onto the draft step (docs/DECODING.md, Drafting).

    Args:
        kind: the circuit family (its defaults).
        greedy: greedy decoding (exact match) or speculative sampling.
        draft: ``path`` | ``map`` | ``chain`` | ``tree``; None: ``tree`` with a
            ``tree_budget``, else ``path``.
        proposal: sampling only: ``path`` | ``first_marginal`` | ``marginal``; None: the
            family's default (:data:`DEFAULT_SAMPLING_PROPOSAL`).
        draft_mode: an old name (one release), exclusive with ``draft`` and ``proposal``.
        tree_budget: nodes per tree (``draft=tree``); 0 or None: no tree.
        tree_floor: tree nodes with q(path) below it are left out; needs a budget.

    Raises:
        SettingsError: an unknown value, or a setting another one would ignore or override.
    """
    _choice("circuit kind", kind, CIRCUIT_KINDS)
    if (
        isinstance(tree_budget, bool)
        or not isinstance(tree_budget, int | None)
        or (tree_budget is not None and tree_budget < 0)
    ):
        raise SettingsError(
            f"tree_budget={tree_budget!r} is not allowed; allowed: an integer >= 0 or None"
        )
    budget = tree_budget or 0
    if (
        isinstance(tree_floor, bool)
        or not isinstance(tree_floor, int | float)
        or not (0 <= tree_floor < 1)
    ):
        raise SettingsError(
            f"tree_floor={tree_floor!r} is not allowed; allowed: a number in [0, 1)"
        )
    if tree_floor and not budget:
        raise SettingsError(
            f"tree_floor={tree_floor} is not allowed without tree_budget; allowed: tree_floor=0, "
            "or a tree_budget >= 1 (the floor prunes a tree's nodes)"
        )
    if draft_mode is not None:
        _choice("draft_mode", draft_mode, DRAFT_MODES)
        if draft is not None or proposal is not None:
            raise SettingsError(
                f"draft_mode={draft_mode!r} is not allowed with draft or proposal; allowed: "
                "draft= and proposal= (draft_mode is their old name, kept for one release)"
            )
        if budget:
            raise SettingsError(
                f"draft_mode={draft_mode!r} is not allowed with tree_budget={budget} (a tree "
                "drafts no chain); allowed: draft=tree tree_budget=B, or no tree_budget"
            )
        if not greedy and draft_mode not in SAMPLED_MODES:
            raise SettingsError(
                f"draft_mode={draft_mode!r} is not allowed with greedy=False; allowed: "
                f"{', '.join(SAMPLED_MODES)} (speculative sampling is exact only for drafts "
                "drawn from the circuit)"
            )
        if (draft_mode, greedy) not in _NOTED:  # once per process, not once per prompt
            _NOTED.add((draft_mode, greedy))
            _log.warning("%s", legacy_note(draft_mode, greedy))
        draft, proposal = LEGACY_DRAFT_MODES[draft_mode]
        return Drafting(draft, None if greedy else proposal, draft_mode)
    if draft is None:
        draft = "tree" if budget else DEFAULT_GREEDY_DRAFT
    _choice("draft", draft, DRAFTS)
    if draft == "tree" and not budget:
        raise SettingsError(
            "draft='tree' is not allowed without tree_budget; allowed: tree_budget=B "
            "(B >= 1 nodes per tree), or draft=path | map | chain"
        )
    if draft != "tree" and budget:
        raise SettingsError(
            f"draft={draft!r} is not allowed with tree_budget={budget}; allowed: draft=tree "
            "(or leave draft out), or tree_budget=0 for a chain"
        )
    if greedy:
        if proposal is not None:
            raise SettingsError(
                f"proposal={proposal!r} is not allowed with greedy=True (greedy verifies by exact "
                "match); allowed: proposal=None, or greedy=False"
            )
        mode = GREEDY_MODES["path" if draft == "tree" else draft]
        return Drafting(draft, None, mode, budget, float(tree_floor))
    if draft in ("map", "chain"):
        raise SettingsError(
            f"draft={draft!r} is not allowed with greedy=False (its drafts are not drawn from "
            "the circuit, so speculative sampling could not be exact); allowed: draft=path or "
            "draft=tree"
        )
    if draft == "tree":
        if proposal is not None:
            raise SettingsError(
                f"proposal={proposal!r} is not allowed with draft=tree (the tree walk verifies "
                "with the target's own draws); allowed: proposal=None, or draft=path"
            )
        default = DEFAULT_SAMPLING_PROPOSAL[kind]
        return Drafting("tree", None, SAMPLING_MODES[default], budget, float(tree_floor))
    chosen = DEFAULT_SAMPLING_PROPOSAL[kind] if proposal is None else proposal
    _choice("proposal", chosen, PROPOSALS)
    return Drafting("path", chosen, SAMPLING_MODES[chosen])


def default_draft_mode(kind: str, greedy: bool) -> str:
    """The draft step's mode a family decodes a chain with when nothing is asked for."""
    return resolve_drafting(kind, greedy).mode


ALGORITHMS = ("slem", "tli", "slrs", "union", "standard")
"""Heterogeneous-vocabulary algorithms (``mtpc.generate_hetero``, docs/HETERO.md)."""
PSI_METHODS = ("auto", "enumerate", "circuit")
"""How SLRS computes psi (``mtpc.generate_hetero``'s ``psi``)."""


@dataclass(frozen=True)
class DecodingSettings:
    """Decoding settings checked without a model (:func:`check_settings`).

    The shared fields apply to every decoder; ``method`` .. ``tree_floor`` to ``mtpc.generate``
    (the drafting fields as given: :meth:`drafting` resolves them for a circuit family);
    ``algorithm`` .. ``psi`` to ``mtpc.generate_hetero`` (``algorithm`` None: not a
    heterogeneous decoding).
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
    draft_mode: str | None = None
    tree_budget: int | None = None
    tree_floor: float = 0.0
    algorithm: str | None = None
    lookahead: int = 5
    look_behind: int = 8
    max_psi_paths: int = 4096
    psi: str = "auto"

    def drafting(self, kind: str) -> Drafting:
        """The drafting choice resolved for circuit family ``kind`` (:func:`resolve_drafting`)."""
        s = self
        return resolve_drafting(
            kind, s.greedy, draft=s.draft, proposal=s.proposal, draft_mode=s.draft_mode,
            tree_budget=s.tree_budget, tree_floor=s.tree_floor,
        )  # fmt: skip


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{name}={value!r} is not allowed; allowed: an integer >= {minimum}")
    return value


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


def check_settings(spell: Callable[[str], str] | None = None, **given: Any) -> DecodingSettings:
    """Checks decoding settings from the settings alone, before any model loads.

    Args:
        spell: the caller's name of a field in messages (``evaluate``: ``drafter.lookahead``);
            None: the field's own name.
        **given: fields of :class:`DecodingSettings`; the others keep their defaults.
            ``algorithm`` given (not None): a heterogeneous decoding (``max_new_tokens`` may
            be 0; the drafting fields are not checked).

    Returns:
        The checked settings.

    Raises:
        SettingsError: one line naming the field and the allowed values.
        TypeError: an unknown field.
    """
    name = spell or (lambda field: field)
    s = DecodingSettings(**given)
    hetero = s.algorithm is not None
    if not hetero:
        _choice(name("method"), s.method, METHODS)
    _integer(name("max_new_tokens"), s.max_new_tokens, 0 if hetero else 1)
    _integer(name("seed"), s.seed, 0)
    if not hetero:
        _choice(name("policy"), s.policy, POLICIES)
    if not isinstance(s.greedy, bool):
        raise SettingsError(f"{name('greedy')}={s.greedy!r} is not allowed; allowed: True, False")
    if not hetero:
        s.drafting("cp")  # the refusals do not depend on the family
    t = s.temperature
    if (
        isinstance(t, bool)
        or not isinstance(t, int | float)
        or math.isnan(t)
        or (not s.greedy and math.isinf(t))
    ):
        raise SettingsError(f"{name('temperature')}={t!r} is not allowed; allowed: a number > 0")
    if not s.greedy and t <= 0:
        raise SettingsError(
            f"{name('temperature')}={t!r} is not allowed with greedy=False; allowed: a "
            "number > 0 (use greedy=True for argmax decoding)"
        )
    if s.top_k is not None:
        _integer(name("top_k"), s.top_k, 1)
    p = s.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1):
        raise SettingsError(
            f"{name('top_p')}={p!r} is not allowed; allowed: a number in (0, 1] or None"
        )
    stops = None if s.stop_ids is None else tuple(check_ids(name("stop_ids"), list(s.stop_ids)))
    if hetero:
        _choice(name("algorithm"), s.algorithm, ALGORITHMS)
        _choice(name("psi"), s.psi, PSI_METHODS)
        _integer(name("lookahead"), s.lookahead, 1)
        _integer(name("look_behind"), s.look_behind, 0)
        _integer(name("max_psi_paths"), s.max_psi_paths, 1)
    return DecodingSettings(
        **{
            **given,
            "temperature": float(t),
            "top_p": None if p is None else float(p),
            "stop_ids": stops,
            "suppress_eos": bool(s.suppress_eos),
            "max_throughput": bool(s.max_throughput),
            "profile": bool(s.profile),
        }
    )
