"""The drafting choice of an evaluation (``drafting``, ``proposal``, ``tree_budget``,
``tree_floor``; docs/DECODING.md, "Drafting"): the evaluation's own refusals and what the
manifest records. ``tree_budget`` adds one ``tree<B>`` row per budget beside the chain row."""

from __future__ import annotations

from typing import Any

from mtpc.decoding.settings import DEFAULT_GREEDY_DRAFT, DecodingSettings, SettingsError


def _budgets(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def tree_budgets(value: Any) -> list[int]:
    """The positive budgets of ``tree_budget`` (null, an int or a list), sorted, no repeats."""
    return sorted({int(v) for v in _budgets(value) if v})


def check_eval_drafting(drafting: Any, tree_budget: Any) -> None:
    """The evaluation's own refusals (SettingsError naming the field and the allowed values):
    ``tree_budget`` an int or a list, no ``drafting=tree`` (the rest of the choice is
    ``mtpc.decoding.settings``'s, in the config's spelling)."""
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


def chain_rule(kind: str, greedy: bool, drafting: Any, proposal: Any) -> str:
    """The draft rule a draft of circuit family ``kind`` decodes the chain passes with."""
    chosen = DecodingSettings(
        greedy=greedy, draft=drafting or DEFAULT_GREEDY_DRAFT, proposal=proposal
    )
    return str(chosen.rule_for(kind)[0])


def asked(drafting: Any, proposal: Any) -> dict[str, Any]:
    """The manifest's record of what was asked (nothing when nothing was: the family's
    defaults). The rule each draft decodes with is in ``drafts[].draft_rule``."""
    return {k: v for k, v in (("drafting", drafting), ("proposal", proposal)) if v is not None}
