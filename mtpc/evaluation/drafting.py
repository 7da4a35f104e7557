"""The drafting choice of an evaluation (``drafting``, ``proposal``, ``tree_budget``,
``tree_floor``), checked before anything loads and mapped onto ``mtpc.generate`` per pass.
The choices: docs/DECODING.md, "Drafting".

In ``configs/eval.yaml`` the chain's draft is ``drafting`` (``draft`` names the exported draft
folder); ``tree_budget`` (an int or a list) adds one ``tree<B>`` row per budget beside the
chain row, so ``drafting=tree`` is refused there.
"""

from __future__ import annotations

from typing import Any

from mtpc.decoding.settings import CONFIG, SettingsError, check_drafting, check_settings


def _budgets(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def tree_budgets(value: Any) -> list[int]:
    """The positive budgets of ``tree_budget`` (null, an int or a list), sorted, no repeats."""
    return sorted({int(v) for v in _budgets(value) if v})


def check_eval_drafting(
    greedy: bool, drafting: Any, proposal: Any, tree_budget: Any, tree_floor: Any
) -> None:
    """Refuses a drafting choice one setting would make another ignore (one line, in the
    config's spelling): the chain row's choice, then the tree rows'.

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
    check_drafting(greedy, drafting, proposal, spell=CONFIG)
    budget = max(tree_budgets(tree_budget), default=0)
    floor = 0.0 if tree_floor is None else tree_floor
    check_drafting(greedy, tree_budget=budget, tree_floor=floor, spell=CONFIG)


def chain_rule(kind: str, greedy: bool, drafting: Any, proposal: Any) -> str:
    """The draft rule a draft of circuit family ``kind`` decodes the chain passes with."""
    checked = check_settings(greedy=greedy, draft=drafting, proposal=proposal)
    return str(checked.rule_for(kind)[0])


def chain_kwargs(drafting: Any, proposal: Any) -> dict[str, Any]:
    """``mtpc.generate`` keywords of the chain passes (speculative, max throughput)."""
    return {"draft": drafting, "proposal": proposal}


def tree_kwargs(budget: int, tree_floor: Any) -> dict[str, Any]:
    """``mtpc.generate`` keywords of a ``tree<B>`` pass (no chain choice: a tree has none)."""
    return {"tree_budget": budget, "tree_floor": float(tree_floor or 0.0)}


def asked(drafting: Any, proposal: Any) -> dict[str, Any]:
    """The manifest's record of what was asked (nothing when nothing was: the family's
    defaults). The rule each draft decodes with is in ``drafts[].draft_rule``."""
    return {k: v for k, v in (("drafting", drafting), ("proposal", proposal)) if v is not None}
