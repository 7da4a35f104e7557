"""Token-tree self-speculative decoding: the circuit's B most probable prefixes, one pass.

A cycle (``mtpc.decoding.loop``: the same states and policies as a chain) starts from the last
processed state e_t with theta_t and, under ``condition``, the pending token c (the root):

1. draft: :func:`mtpc.circuits.tree.build_tree` picks the ``tree_budget`` most probable draft
   prefixes under q(. | c) (exact joint prefix probabilities, one batched circuit query per
   depth), no deeper than the window;
2. verify: ONE trunk + verifier pass over [c] + the nodes, with a tree attention mask (each
   node sees the cache, its ancestors and itself) and position ids cache length + depth;
   the verifier row of a node is the target's p(. | context, root path of the node);
3. walk from the root: t = the target's choice at the current node (argmax, or a sample of
   its processed distribution); if t is a child, accept it and descend; else emit t and stop.
   Every emitted token is the target's own choice given the emitted prefix, so the output is
   the target's (greedy: token for token; sampling: in distribution, whatever the tree);
4. caches: keep the root and the accepted path by index (``Caches.compact``), run the draft
   tail on those kept states.

No node is accepted unless the target itself picks it, so for a deterministic tree this walk
accepts p(children) at each node: the most any exact rule can (the emitted token must be
distributed as p, and a descent needs it among the children).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.tree import TokenTree, build_tree
from mtpc.decoding.common import GenerationResult, Request, TargetRule
from mtpc.decoding.loop import HeadState, Outcome, Proposal, Row, Run, decode


def verify_layout(tree: TokenTree, root: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Ids, tree mask and depths of one verify pass: the pending root (if any) then the nodes.

    Returns:
        ids (T,), tree_mask (T, T) bool, depth (T,) (the root 0; nodes from 1 with a root,
        from 0 without one), T = len(tree) + (1 if root is not None).
    """
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
    generator: torch.Generator | None,
    max_throughput: bool = False,
) -> tuple[list[int], list[int], int]:
    """Exact verification of a token tree: descend while the target's choice is a child.

    Args:
        tree: the drafted nodes.
        target: ``(N + 1, V)`` the target's logits at the root, then at each node (row
            1 + i: node i's).
        rule: greedy argmax or processed sampling.
        generator: RNG for sampling.
        max_throughput: accept the most probable child at every node (not lossless).

    Returns:
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
            token = rule.pick(target[node + 1], generator)
        if token not in kids:
            return path, tokens, token
        node = kids[token]
        path.append(node)
        tokens.append(token)


class Tree:
    """The token-tree proposer: ``tree_budget`` nodes per cycle (``tree_floor``: fewer), one
    pass under a tree mask, verified by :func:`walk`.

    Args:
        request: checked arguments (``tree_budget`` >= 1).
    """

    def __init__(self, request: Request) -> None:
        self.budget, self.floor = request.tree_budget, request.tree_floor
        self.labels = {"draft_rule": f"tree{self.budget}", "draft": "tree", "proposal": None}

    def begin(self, state: HeadState) -> None:
        """theta_t's whole table, as soon as the state exists (``build_tree`` reads it)."""
        state.params()

    def draft(self, row: Row, evidence: Tensor | None, span: int) -> Proposal:
        """The ``budget`` most probable draft prefixes under q(. | evidence), the root
        included no deeper than ``span``."""
        state, pre = row.head, 0 if evidence is None else 1
        tree = build_tree(
            state.circuit, state.params(), evidence, self.budget, self.floor, span - pre
        )
        ids, mask, depth = verify_layout(tree, row.pending)
        return Proposal(ids[None], pre, tree, depth, mask)

    def draft_rows(
        self, rows: Sequence[Row], evidence: Sequence[Tensor | None], spans: Sequence[int]
    ) -> list[Proposal]:
        """Each row's tree (:meth:`draft`)."""
        return [self.draft(*a) for a in zip(rows, evidence, spans, strict=True)]

    def verify(self, run: Run, row: Row, proposal: Proposal, target: Tensor) -> Outcome:
        """:func:`walk`; keeps the root and the accepted path; records the tree's nodes and
        expected acceptance."""
        tree: TokenTree = proposal.drafts
        rule, max_throughput = run.rule, run.request.max_throughput
        path, accepted, token = walk(tree, target, rule, row.generator, max_throughput)
        row.res.nodes.append(len(tree))
        row.res.expected.append(tree.expected_by_depth(row.head.circuit.window - proposal.pre))
        keep = ([0] if proposal.pre else []) + [proposal.pre + i for i in path]
        return Outcome(
            accepted,
            token,
            drafted=int(tree.depths.max()) if len(tree) else 0,
            keep=torch.tensor(keep, dtype=torch.long, device=proposal.ids.device),
            after=1 + path[-1] if path else 0,
        )


def tree_generate(model: Any, prompt: Tensor, request: Request) -> GenerationResult:
    """Self-speculative decoding with a token tree of ``request.tree_budget`` nodes per cycle
    (``mtpc.decoding.loop.decode``).

    Args:
        model: an ``MTPCModel`` whose backbone ``supports_tree_mask``.
        prompt: (1, T) ids on the model's device.
        request: checked arguments (``tree_budget`` >= 1).

    Returns:
        A :class:`GenerationResult`; ``nodes`` and ``expected`` are filled per cycle.
    """
    return decode(model, [prompt[0]], [request], Tree(request))[0]
