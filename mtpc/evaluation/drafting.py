"""The drafting choice of an evaluation (``drafting``, ``proposal``, ``tree_budget``,
``tree_floor``; the old ``draft_mode``), checked before anything loads and mapped onto
``mtpc.generate`` per pass. The choices: docs/DECODING.md, "Drafting".

In ``configs/eval.yaml`` the chain's draft is ``drafting`` (``draft`` names the exported draft
folder); ``tree_budget`` (an int or a list) adds one ``tree<B>`` row per budget beside the
chain row, so ``drafting=tree`` is refused there.
"""

from __future__ import annotations

from typing import Any

from mtpc.decoding.settings import (
    LEGACY_DRAFT_MODES,
    SettingsError,
    resolve_drafting,
)


def _budgets(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def tree_budgets(value: Any) -> list[int]:
    """The positive budgets of ``tree_budget`` (null, an int or a list), sorted, no repeats."""
    return sorted({int(v) for v in _budgets(value) if v})


def check_drafting(
    greedy: bool,
    drafting: Any,
    proposal: Any,
    draft_mode: Any,
    tree_budget: Any,
    tree_floor: Any,
) -> None:
    """Refuses a drafting choice one setting would make another ignore (one line).

    Raises:
        SettingsError: naming the field and the allowed values.
    """
    for b in _budgets(tree_budget):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise SettingsError(
                f"tree_budget={tree_budget!r} is not allowed; allowed: null, an integer >= 0 or "
                "a list of them, e.g. tree_budget=[16,32,64]"
            )
    if drafting == "tree":
        raise SettingsError(
            "drafting=tree is not allowed in an evaluation; allowed: drafting=path | map | chain "
            "(the chain row) with tree_budget=B or [B1,B2] (one tree row per budget)"
        )
    budgets = tree_budgets(tree_budget)
    floor = 0.0 if tree_floor is None else tree_floor
    for kind in ("ff", "cp"):  # the defaults differ by family; the refusals do not
        resolve_drafting(kind, greedy, draft=drafting, proposal=proposal, draft_mode=draft_mode)
        resolve_drafting(kind, greedy, tree_budget=max(budgets, default=0), tree_floor=floor)


def chain_kwargs(drafting: Any, proposal: Any, draft_mode: Any) -> dict[str, Any]:
    """``mtpc.generate`` keywords of the chain passes (speculative, max throughput)."""
    return {"draft": drafting, "proposal": proposal, "draft_mode": draft_mode}


def tree_kwargs(budget: int, tree_floor: Any) -> dict[str, Any]:
    """``mtpc.generate`` keywords of a ``tree<B>`` pass (no chain choice: a tree has none)."""
    return {"tree_budget": budget, "tree_floor": float(tree_floor or 0.0)}


def asked(greedy: bool, drafting: Any, proposal: Any, draft_mode: Any) -> dict[str, Any]:
    """The manifest's record of what was asked, one spelling for the old and the new names.

    ``draft_mode=zsample1`` and ``drafting=path proposal=first_marginal`` are the same
    measurement and key the same folder; nothing asked records ``draft_mode: null`` only (the
    key of older evaluations). The mode each draft decodes with is in ``drafts[].draft_mode``.
    """
    if draft_mode is not None:
        draft, prop = LEGACY_DRAFT_MODES[draft_mode]
        if greedy and prop is not None:  # a drawn path under greedy: no new name
            return {"draft_mode": draft_mode}
        drafting, proposal = draft, None if greedy else prop
    out: dict[str, Any] = {"draft_mode": None}
    if drafting is not None:
        out["drafting"] = drafting
    if proposal is not None:
        out["proposal"] = proposal
    return out
