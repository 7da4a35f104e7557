"""Token-tree self-speculative decoding: the circuit's B most probable prefixes verified in one
pass under a tree mask, accepted by :func:`walk` (the target's own choices, so exact whatever
the tree). See docs/DECODING.md, "Token trees".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtpc.circuits.tree import TokenTree, build_tree
from mtpc.decoding.common import Request, TargetRule
from mtpc.decoding.draws import EMIT, Draws
from mtpc.decoding.loop import HeadState, Outcome, Proposal, Row, Run


def verify_layout(tree: TokenTree, root: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Ids ``(T,)``, tree mask ``(T, T)`` bool and depths ``(T,)`` of one verify pass: the
    pending root (if any, depth 0) then the nodes (depths from 1 with a root, else from 0)."""
    mask = tree.ancestor_mask()  # (N, N)
    if root is None:
        return tree.tokens, mask, tree.depths - 1
    t = len(tree) + 1
    full = torch.zeros(t, t, dtype=torch.bool, device=mask.device)
    full[:, 0] = True
    full[1:, 1:] = mask
    ids = torch.cat([tree.tokens.new_tensor([root]), tree.tokens])
    return ids, full, torch.cat([tree.depths.new_zeros(1), tree.depths])


def walk(
    tree: TokenTree,
    target: Tensor,
    rule: TargetRule,
    u: Tensor | None,
    max_throughput: bool = False,
) -> tuple[list[int], list[int], int]:
    """Exact verification of a token tree: descend while the target's choice is a child.

    ``target``: ``(N + 1, V)`` the target's logits at the root, then at each node (row 1 + i:
    node i's); ``u`` ``(depth + 1,)``: the row's uniforms of the target's choice at each depth
    (sampling); ``max_throughput``: take the most probable child (not lossless). Returns
    (accepted node indices, accepted tokens, the emitted token after them).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (p, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        children.setdefault(p, {}).setdefault(tok, i)  # the first child is the most probable
    choices = rule.argmax(target).tolist() if rule.greedy else None
    node, path, tokens = -1, list[int](), list[int]()
    while True:
        kids = children.get(node, {})
        if max_throughput and kids:
            token = next(iter(kids))
        elif choices is not None:
            token = choices[node + 1]
        else:
            assert u is not None
            token = int(rule.draw(target[node + 1], u[len(path)]))
        if token not in kids:
            return path, tokens, token
        node = kids[token]
        path.append(node)
        tokens.append(token)


class Tree:
    """The token-tree proposer: ``tree_budget`` nodes per cycle (``tree_floor``: fewer), one
    pass under a tree mask, verified by :func:`walk`."""

    def __init__(self, request: Request) -> None:
        self.budget, self.floor = request.tree_budget, request.tree_floor
        self.labels = {"draft_rule": f"tree{self.budget}", "draft": "tree", "proposal": None}

    def begin(self, state: HeadState) -> None:
        """theta_t's whole table, as soon as the state exists (``build_tree`` reads it)."""
        state.params()

    def draft_rows(
        self,
        rows: Sequence[Row],
        evidence: Sequence[Tensor | None],
        spans: Sequence[int],
        draws: Draws,
    ) -> list[Proposal]:
        """Each row's ``budget`` most probable draft prefixes under q(. | evidence), the root
        included no deeper than its span (deterministic: no draws)."""
        out = []
        for row, ev, span in zip(rows, evidence, spans, strict=True):
            pre = 0 if ev is None else 1
            tree = build_tree(
                row.head.circuit, row.head.params(), ev, self.budget, self.floor, span - pre
            )
            ids, mask, depth = verify_layout(tree, row.pending)
            out.append(Proposal(ids[None], pre, tree, (depth, mask)))
        return out

    def verify_rows(
        self,
        run: Run,
        rows: Sequence[Row],
        proposals: Sequence[Proposal],
        targets: Sequence[Tensor],
        draws: Draws,
    ) -> list[Outcome]:
        """:func:`walk` of each row with its uniforms (``(n + 1,)``, all rows' in one tensor
        op); keeps the root and the accepted path; records the tree's nodes and expected
        acceptance."""
        us: Sequence[Tensor | None] = [None] * len(rows)
        if not run.rule.greedy:  # (max_throughput too: a leaf's token is the target's)
            us = list(draws.take(EMIT, rows[0].head.circuit.window + 1))  # (n + 1,) each
        out = []
        for row, proposal, target, u in zip(rows, proposals, targets, us, strict=True):
            tree: TokenTree = proposal.drafts
            path, accepted, token = walk(tree, target, run.rule, u, run.request.max_throughput)
            row.res.nodes.append(len(tree))
            row.res.expected.append(tree.expected_by_depth(row.head.circuit.window - proposal.pre))
            keep = ([0] if proposal.pre else []) + [proposal.pre + i for i in path]
            out.append(
                Outcome(
                    accepted,
                    token,
                    drafted=int(tree.depths.max()) if len(tree) else 0,
                    keep=torch.tensor(keep, dtype=torch.long, device=proposal.ids.device),
                    after=1 + path[-1] if path else 0,
                )
            )
        return out
