"""Token-tree self-speculative decoding: the circuit's B most probable prefixes, one pass.

A cycle (same states and policies as ``mtpc.decoding.speculative``) starts from the last
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

from typing import Any

import torch
from torch import Tensor

from mtpc.circuits.tree import TokenTree, build_tree
from mtpc.decoding.common import GenerationResult, Request, Stopwatch, TargetRule, emit
from mtpc.decoding.speculative import HeadState, resume


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
    rows: Tensor,
    first: Tensor,
    rule: TargetRule,
    generator: torch.Generator | None,
    offset: int,
    max_throughput: bool = False,
) -> tuple[list[int], list[int], int]:
    """Exact verification of a token tree: descend while the target's choice is a child.

    Args:
        tree: the drafted nodes.
        rows: (T, V) target logits of the verify pass (row ``offset + i`` is node i's).
        first: (V,) the target's logits at the root.
        rule: greedy argmax or processed sampling.
        generator: RNG for sampling.
        offset: 1 when the pass starts with the pending root, else 0.
        max_throughput: accept the most probable child at every node (not lossless).

    Returns:
        (accepted node indices, accepted tokens, the emitted token after them).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (p, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        children.setdefault(p, {}).setdefault(tok, i)  # the first child is the most probable
    choices = rule.argmax(torch.cat([first[None], rows[offset:]])).tolist() if rule.greedy else None
    node, path, tokens = -1, list[int](), list[int]()
    while True:
        kids = children.get(node, {})
        if max_throughput and kids:
            token = next(iter(kids))
        elif choices is not None:
            token = choices[node + 1]
        else:
            token = rule.pick(first if node < 0 else rows[offset + node], generator)
        if token not in kids:
            return path, tokens, token
        node = kids[token]
        path.append(node)
        tokens.append(token)


@torch.no_grad()
def tree_generate(model: Any, prompt: Tensor, request: Request) -> GenerationResult:
    """Self-speculative decoding with a token tree of ``request.tree_budget`` nodes per cycle.

    Args:
        model: an ``MTPCModel`` whose backbone ``supports_tree_mask``.
        prompt: (1, T) ids on the model's device.
        request: checked arguments (``tree_budget`` >= 1).

    Returns:
        A :class:`GenerationResult`; ``nodes`` and ``expected`` are filled per cycle.
    """
    circuit = model.head.circuit
    n = circuit.window
    device = model.backbone.device
    generator = torch.Generator(device=device).manual_seed(request.seed)
    rule = TargetRule(request, model.backbone.vocab_size, device)
    policy = request.policy
    draft_temp = None if request.greedy else request.temperature
    caches = model.new_caches()
    clock = Stopwatch(device, request.profile)

    hidden = model.trunk(prompt, caches.trunk)  # (1, T, d)
    kept_logits = model.verifier_logits(
        model.verifier_tail(hidden, caches.verifier)[:, -1]
    )  # (1, V)
    params = HeadState(model, model.draft_tail(hidden, caches.draft)[:, -1], draft_temp).params()
    pending: int | None = None
    res = GenerationResult(
        tokens=[],
        method="speculative",
        policy=policy,
        draft_rule=f"tree{request.tree_budget}",
        draft="tree",
        prefill_seconds=clock.split(),
    )
    out = res.tokens

    while True:
        pre = 0 if pending is None else 1
        evidence = None if pending is None else torch.tensor([[pending]], device=device)
        base = len(caches.trunk)
        # positions base.. that one pass verifies exactly (EvaByte: up to its window's end)
        span = model.backbone.one_pass_span(base, n)
        tree = build_tree(
            circuit, params, evidence, request.tree_budget, request.tree_floor, span - pre
        )
        clock.lap("circuit")

        ids, mask, depth = verify_layout(tree, pending)
        if ids.numel():
            positions = base + depth  # (T,)
            hidden = model.trunk(ids[None], caches.trunk, positions, tree_mask=mask)  # (1, T, d)
            tail = model.verifier_tail(hidden, caches.verifier, positions, tree_mask=mask)
            rows = model.verifier_logits(tail)[0]  # (T, V)
            res.trunk_passes += 1
        else:
            hidden = kept_logits.new_zeros(1, 0, model.backbone.hidden_size)
            rows = kept_logits.new_zeros(0, kept_logits.shape[-1])
        first = rows[0] if pre else kept_logits[0]  # (V,) the target at the root
        clock.lap("model")
        path, accepted, token = walk(
            tree, rows, first, rule, generator, pre, request.max_throughput
        )
        s = len(accepted)
        clock.lap("verify")

        drop = policy == "drop" and s >= 1 and not request.max_throughput
        count, stopped = emit(
            out, accepted + ([] if drop else [token]), request, ignore_stops=request.suppress_eos
        )
        res.accepted.append(s)
        res.emitted.append(count)
        res.drafted.append(int(tree.depths.max()) if len(tree) else 0)
        res.offsets.append(pre)
        res.nodes.append(len(tree))
        res.expected.append(tree.expected_by_depth(n - pre))
        if stopped or len(out) >= request.max_new_tokens:
            res.stopped = stopped
            res.cycle_seconds.append(clock.split())
            break

        keep = torch.tensor(
            ([0] if pre else []) + [pre + i for i in path], dtype=torch.long, device=device
        )
        if keep.numel() < ids.numel():
            caches.compact(base, keep)
        clock.lap("cache")
        after_path = rows[pre + path[-1]][None] if drop else kept_logits  # (1, V)
        kept, pending, kept_logits = resume(
            model, caches, hidden[:, keep], token, policy, drop, after_path, kept_logits, res
        )
        if kept.shape[1]:
            state = model.draft_tail(kept, caches.draft)[:, -1]  # (1, d)
            clock.lap("model")
            params = HeadState(model, state, draft_temp).params()
            clock.lap("head")
        clock.lap("cache")
        res.cycle_seconds.append(clock.split())

    res.seconds = res.prefill_seconds + sum(res.cycle_seconds)
    res.breakdown = clock.breakdown(sum(res.cycle_seconds))
    return res
