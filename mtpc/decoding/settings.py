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

This module is torch-free: evaluation configs are checked with it before anything loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mtpc.choices import CIRCUIT_KINDS, DRAFT_MODES, DRAFTS, PROPOSALS

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
    """The one-line note an old ``draft_mode`` name logs: what it is now."""
    draft, proposal = LEGACY_DRAFT_MODES[draft_mode]
    if greedy and proposal is not None:
        return (
            f"draft_mode={draft_mode} with greedy=True drafts a drawn latent path (no new name; "
            "draft=path drafts the most probable one); see docs/DECODING.md, Drafting"
        )
    if not greedy and proposal is None:
        return f"draft_mode={draft_mode} is draft={draft} (greedy only)"
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
