"""Token trees from a circuit: the B most probable draft prefixes, found best-first, one
batched circuit query per depth; why this is exact: docs/DECODING.md, "Token trees"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.params import CircuitParams


@dataclass(frozen=True)
class TokenTree:
    """Draft nodes below a root, in topological order (every parent before its children)."""

    tokens: Tensor  # (T,) the node ids
    parents: Tensor  # (T,) index of each node's parent in ``tokens``, -1 below the root
    depths: Tensor  # (T,) depth below the root (1 for the root's children)
    log_probs: Tensor  # (T,) log q(root path of the node | evidence)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expected_accepted(self) -> float:
        """Expected accepted drafts under q: the sum of the nodes' path probabilities."""
        return float(self.log_probs.exp().sum())

    def expected_by_depth(self, depth: int) -> list[float]:
        """P_q(at least d drafts accepted) for d = 1..depth (sum over the nodes at depth d)."""
        probs = self.log_probs.exp().double().cpu()  # (T,) on the CPU with the counts
        out = torch.zeros(depth + 1, dtype=torch.float64).index_add_(0, self.depths.cpu(), probs)
        return out[1:].tolist()

    def ancestor_mask(self) -> Tensor:
        """(T, T) bool: [i, j] True when node j is node i or one of its ancestors."""
        t = len(self)
        mask = torch.eye(t, dtype=torch.bool)  # built on the CPU: T small row ops, then one copy
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i] |= mask[p]
        return mask.to(self.tokens.device)


@torch.no_grad()
def build_tree(
    circuit: Any,
    params: CircuitParams,
    evidence: Tensor | None,
    budget: int,
    floor: float = 0.0,
    max_depth: int | None = None,
) -> TokenTree:
    """The ``budget`` (>= 1) most probable draft prefixes under q(. | evidence), as a tree.
    ``params``: one state's (B = 1); ``evidence``: (1, m) or None; ``floor``: nodes with
    q(path | evidence) below it are left out; ``max_depth``: caps the levels (EVA window)."""
    n = circuit.window
    device = params.input_logp.device
    prefixes = (
        torch.zeros(1, 0, dtype=torch.long, device=device) if evidence is None else evidence
    )  # (P, m + d)
    depth = n - prefixes.shape[1]
    if max_depth is not None:
        depth = max(0, min(depth, max_depth))
    level_logp = torch.zeros(1, device=device)  # (P,) log q(prefix | evidence)
    level_index = torch.full((1,), -1, dtype=torch.long, device=device)  # (P,) node indices
    cut = math.log(floor) if floor > 0 else -math.inf
    tokens, parents, depths, logps = [], [], [], []
    count = 0
    independent = circuit.num_sum_units == 0  # ff: the positions are independent
    for d in range(1, depth + 1):
        # ff: q(x_d | prefix) is the marginal of position d, the same for every row
        rows = 1 if independent else prefixes.shape[0]
        cond = circuit.conditional_log_prob(params.expand(rows), prefixes[:rows])  # (rows, V)
        joint = (level_logp[:, None] + cond.clamp(max=0.0)).flatten()  # (P * V,)
        top = joint.topk(min(budget, joint.numel()))
        ok = top.values > cut
        values, flat = top.values[ok], top.indices[ok]
        if not values.numel():
            break
        vocab = cond.shape[1]
        parent, token = flat // vocab, flat % vocab
        tokens.append(token)
        parents.append(level_index[parent])
        depths.append(torch.full_like(token, d))
        logps.append(values)
        level_index = torch.arange(count, count + token.numel(), device=device)
        count += token.numel()
        prefixes = torch.cat([prefixes[parent], token[:, None]], 1)
        level_logp = values
        if count >= budget and d < depth:
            best = torch.cat(logps).topk(budget).values[-1]
            if bool(values[0] <= best):  # no descendant can enter the best `budget`
                break
    if not tokens:  # a tree without nodes
        none = torch.zeros(0, dtype=torch.long, device=device)
        return TokenTree(none, none, none, torch.zeros(0, device=device))
    all_tokens, all_parents = torch.cat(tokens), torch.cat(parents)
    all_depths, all_logp = torch.cat(depths), torch.cat(logps)
    # the best `budget` nodes; ties go to the shallower node, so the set stays prefix-closed
    order = (-all_logp).argsort(stable=True)[:budget]  # levels were appended by depth
    chosen = order.sort().values  # (T,) topological: levels were appended in depth order
    renumber = torch.full((count + 1,), -1, dtype=torch.long, device=device)
    renumber[chosen] = torch.arange(chosen.numel(), device=device)
    new_parents = renumber[all_parents[chosen]]  # -1 (root) maps through renumber[-1] = -1
    return TokenTree(all_tokens[chosen], new_parents, all_depths[chosen], all_logp[chosen])
