"""One generic engine that answers every query on any layered structure. Activations are
log-values ``(B, F, R, K)``: batch, folds, units and K query columns that share their row's
parameters. See docs/CIRCUITS.md, "Queries"."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mtpc.circuits.params import CircuitParams, _f32
from mtpc.circuits.structure import Layer, Slot, Structure


class _Step(NamedTuple):
    """One fold of a prefix pass (``Circuit._prefix_plan``)."""

    is_sum: bool
    fold: tuple[int, int]  # (layer, fold)
    kids: tuple[tuple[int, int], ...]  # its children that depend on the prefix
    lo: int  # first sum-weight row
    num_units: int  # R


class Circuit:
    """Queries on a layered structure with contextual parameters."""

    def __init__(self, structure: Structure) -> None:
        self.structure = structure
        self.kind, self.window, self.rank = structure.kind, structure.window, structure.rank
        self.num_sum_units = structure.num_sum_rows  # U, rows of ``CircuitParams.sum_logw``
        self.layers: tuple[Layer, ...] = structure.layers
        n = structure.window
        # prefix mask: column k keeps positions 0..k
        self._tri = torch.ones(n, n, dtype=torch.bool).tril().T.unsqueeze(1)  # (n, 1, n)
        self._device_cache: dict[tuple[int, torch.device], Tensor] = {}
        # prefix fast path: layer 1 multiplies consecutive inputs and nobody else reads them
        self._prefix_index: Tensor | None = None
        l1 = self.layers[min(1, len(self.layers) - 1)]  # view_start: None but for products
        readers = sum(1 for la in self.layers[1:] for sl in la.slots if 0 in sl.sources)
        if l1.view_start == 0 and l1.num_folds * l1.arity == n and readers == l1.arity:
            starts = torch.arange(l1.num_folds) * l1.arity  # (F,) first inputs; the index: (F, n)
            self._prefix_index = (torch.arange(n)[None] - starts[:, None] + 1).clamp(0, l1.arity)
        # top-down walk: per sum layer, root first, the weight row of unit 0 of each position's
        # ancestor fold there (tree-shaped: at most one fold of a layer holds a position), and
        # which positions have one; products keep the unit index (Hadamard)
        self._walk: list[tuple[Tensor, Tensor | None]] = []
        for la in reversed([la for la in self.layers if la.kind == "sum"]):
            rows = torch.full((n,), la.sum_offset, dtype=torch.long)
            has = torch.zeros(n, dtype=torch.bool)
            for f, scope in enumerate(la.scopes):
                rows[list(scope)] = la.sum_offset + f * la.num_units
                has[list(scope)] = True
            self._walk.append((rows, None if bool(has.all()) else has))
        # every inner fold's children (layer, fold), for the prefix passes
        self._kids: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for lid, la in enumerate(self.layers[1:], 1):
            for slot in la.slots:
                where = [(s, f) for s in slot.sources for f in range(self.layers[s].num_folds)]
                for f, i in enumerate(slot.index.tolist()):  # i: in the concatenated sources
                    self._kids.setdefault((lid, f), []).append(where[i])
        self._prefix_plans: dict[int, tuple[_Step, ...] | None] = {}

    def __repr__(self) -> str:
        return f"Circuit({self.structure!r})"

    def log_prob(self, params: CircuitParams, x: Tensor) -> Tensor:
        """``(B,)`` log q(x_1..x_n) of full windows ``x`` ``(B, n)``."""
        leaves, lw = self._leaves(params, x, None, "")
        return self._upward(leaves.unsqueeze(-1), lw)[0][:, 0, 0]  # leaves: (B, n, r, 1)

    def prefix_log_prob(
        self, params: CircuitParams, x: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """``(B, n)``, column i = log q(x_1..x_{i+1}); ``mask`` False: summed out, id unchecked."""
        return self.prefix_from_leaves(*self._leaves(params, x, mask, "mask"))

    def prefix_from_leaves(self, leaves: Tensor, sum_logw: Tensor | None) -> Tensor:
        """``(B, n)`` prefix log-marginals from ``leaves`` ``(B, n, r)``, log phi at the tokens
        (0 for a missing position), and normalised ``sum_logw`` ``(B, U, r)`` or None."""
        if self._prefix_index is not None and self._prefix_index.shape[1] > 1:
            # First layer = products of consecutive inputs, read by nobody else: column k of
            # fold f is a prefix sum of its inputs, so gather from cumulative sums instead
            # of materialising the (B, n, r, n) input columns (CP: O(n r), not O(n^2 r)).
            B, n, r = leaves.shape
            F = self.layers[1].num_folds
            cum = leaves.view(B, F, n // F, r).cumsum(2)
            cum = torch.cat([cum.new_zeros(B, F, 1, r), cum], 2)  # (B, F, A + 1, r)
            idx = self._on(self._prefix_index, leaves.device)  # (F, n)
            first = cum.gather(2, idx[None, :, :, None].expand(B, F, n, r)).transpose(2, 3)
            return self._upward(leaves, sum_logw, first=first)[0][:, 0]
        tri = self._on(self._tri, leaves.device)
        cols = torch.where(tri, leaves.unsqueeze(-1), 0.0)  # (B, n, r, n)
        return self._upward(cols, sum_logw)[0][:, 0]

    def marginal_log_prob(self, params: CircuitParams, x: Tensor, observed: Tensor) -> Tensor:
        """``(B,)`` log-marginal of the ``observed`` ``(B, n)`` positions of ``x`` ``(B, n)``."""
        leaves, lw = self._leaves(params, x, observed, "observed")
        return self._upward(leaves.unsqueeze(-1), lw)[0][:, 0, 0]

    def conditional_log_prob(self, params: CircuitParams, prefix: Tensor | None = None) -> Tensor:
        """``(B, V)`` log q(x_{m+1} = v | x_1..x_m) for ``prefix`` ``(B, m)``, 0 <= m < n."""
        lp, lw = self._unpack(params)
        B, n, r, _ = lp.shape
        m = self._check_evidence(prefix, lp, name="prefix", max_len=n - 1)
        obs = leaf_values(lp, prefix) if prefix is not None and m else lp.new_zeros(B, 0, r)
        return self.conditional_from_leaves(obs, lp[:, m], lw)

    def conditional_from_leaves(
        self, leaves: Tensor, next_logp: Tensor, sum_logw: Tensor | None
    ) -> Tensor:
        """``(B, V)`` log q(x_{m+1} = v | x_1..x_m) from the input units it reads, nothing more.
        ``leaves`` ``(B, m, r)``: log phi of the first m positions at their tokens;
        ``next_logp`` ``(B, r, V)``: every unit of position m."""
        # The circuit is linear in position m's input vector (smooth and decomposable: every
        # product path reads one of its units), so q(x_m = v | x_<m) is proportional to
        # sum_j g_j phi_{m, j}(v), where g_j is the circuit with position m's inputs set to
        # the unit vector e_j, the prefix at its tokens and the later positions summed out
        # (log 1). One upward pass over r columns (not V) gives log g; then one r x V
        # log-sum-exp.
        B, m, r = leaves.shape
        unit = torch.eye(r, dtype=next_logp.dtype, device=next_logp.device).log()  # (r, r): log e_j
        if sum_logw is not None and (plan := self._prefix_plan(m + 1)) is not None:
            # only the folds above positions 0..m (every other one is log 1)
            inputs = {(0, p): leaves[:, p].unsqueeze(-1).to(next_logp.dtype) for p in range(m)}
            inputs[(0, m)] = unit.unsqueeze(0)
            log_g = self._prefix_values(plan, inputs, _f32(sum_logw).to(next_logp.dtype))[:, 0]
        else:
            before = leaves.unsqueeze(-1).expand(B, m, r, r).to(next_logp.dtype)
            after = next_logp.new_zeros(B, self.window - m - 1, r, r)
            cols = torch.cat([before, unit.expand(B, 1, r, r), after], 1)  # (B, n, r, r)
            log_g = self._upward(cols, sum_logw)[0][:, 0]  # (B, r)
        root = torch.logsumexp(log_g.unsqueeze(-1) + next_logp, dim=1)  # (B, V)
        return torch.log_softmax(root, dim=-1)

    @torch.no_grad()
    def sample(
        self,
        params: CircuitParams,
        generator: torch.Generator | None = None,
        evidence: Tensor | None = None,
    ) -> Tensor:
        """``(B, n)`` ancestral sample (paper Alg. 1), exact given ``evidence`` ``(B, m <= n)``."""
        return self._top_down(params, evidence, generator, max_product=False)

    @torch.no_grad()
    def map_decode(self, params: CircuitParams, evidence: Tensor | None = None) -> Tensor:
        """``(B, n)`` max-product (approximate MAP) decoding: the mode over tokens and latents."""
        return self._top_down(params, evidence, None, max_product=True)

    @torch.no_grad()
    def greedy_chain(self, params: CircuitParams, evidence: Tensor | None = None) -> Tensor:
        """``(B, n)`` greedy chain of exact conditionals: x_i = argmax q(x_i | x_<i), i > m."""
        lp, _ = self._unpack(params)
        m = self._check_evidence(evidence, lp, name="evidence", max_len=self.window)
        x = lp.new_zeros(lp.shape[0], 0, dtype=torch.long) if evidence is None else evidence
        for _ in range(m, self.window):
            nxt = self.conditional_log_prob(params, x).argmax(-1, keepdim=True)  # (B, 1)
            x = torch.cat([x, nxt], 1)
        return x

    def _upward(
        self,
        leaves: Tensor,
        sum_logw: Tensor | None,
        *,
        max_product: bool = False,
        first: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor | None]]:
        """Bottom-up pass over ``leaves`` ``(B, n, r, K)`` (or layer 1's output ``first``): the
        root ``(B, 1, K)`` and per layer its sum inputs ``(B, F, r, K)`` (or None)."""
        r = self.rank
        outs = [leaves] if first is None else [leaves, first]
        sum_inputs: list[Tensor | None] = [None] * len(outs)
        B, K = outs[-1].shape[0], outs[-1].shape[-1]
        wexp = None
        fmin = torch.finfo(leaves.dtype).min
        for la in self.layers[len(outs) :]:
            F, R, A, lo, slots = la.num_folds, la.num_units, la.arity, la.sum_offset, la.slots
            if la.kind == "product":
                sum_inputs.append(None)
                if la.view_start is not None:  # consecutive folds of its one source
                    src = outs[slots[0].sources[0]].narrow(1, la.view_start, F * A)
                    y = src.unflatten(1, (F, A)).sum(2) if A > 1 else src  # (B, F, r, K)
                else:
                    y = self._read(outs, slots[0])
                    for slot in slots[1:]:
                        y = y + self._read(outs, slot)
            else:
                assert sum_logw is not None
                c = self._read(outs, slots[0])  # (B, F, r, K)
                sum_inputs.append(c)
                if max_product:
                    w = sum_logw[:, lo : lo + F * R].view(B, F, R, r, 1)
                    y = (w + c.unsqueeze(2)).amax(3)  # (B, F, R, K)
                else:
                    if wexp is None:
                        wexp = sum_logw.exp()  # (B, U, r)
                    w = wexp[:, lo : lo + F * R].reshape(B * F, R, r)
                    mx = c.detach().amax(2, keepdim=True).clamp_min(fmin)  # (B, F, 1, K)
                    z = torch.exp(c - mx).reshape(B * F, r, K)
                    y = torch.bmm(w, z).view(B, F, R, K).log() + mx  # (B, F, R, K)
            outs.append(y)
        return outs[-1].view(B, 1, K), sum_inputs

    def _top_down(
        self,
        params: CircuitParams,
        evidence: Tensor | None,
        generator: torch.Generator | None,
        *,
        max_product: bool,
    ) -> Tensor:
        """Select one unit per fold from the root down, then the free tokens."""
        lp, lw = self._unpack(params)
        m = self._check_evidence(evidence, lp, name="evidence", max_len=self.window)
        B, n, r, V = lp.shape
        ev = lp.new_zeros(B, 0, dtype=torch.long) if evidence is None or not m else evidence
        if m == n:
            return ev.clone()
        if lw is None:  # no sum unit: one unit per position
            units = lp.new_zeros(B, n, dtype=torch.long)
        else:  # every choice at once (no evidence: the prior); the walk down follows indices
            scores = lw
            if max_product or m:
                free = lp[:, m:].amax(-1) if max_product else lp.new_zeros(B, n - m, r)
                leaves = torch.cat([leaf_values(lp, ev), free], 1)  # (B, n, r)
                scores = self._posterior(leaves, lw, max_product=max_product)
            choice = scores.argmax(-1) if max_product else categorical(scores, generator)
            units = self._walk_down(choice)  # (B, n)
        idx = units[:, m:, None, None].expand(B, n - m, 1, V)
        logits = lp[:, m:].gather(2, idx).squeeze(2)  # (B, n - m, V)
        tokens = logits.argmax(-1) if max_product else categorical(logits, generator)
        return torch.cat([ev, tokens], 1)

    @torch.no_grad()
    def latent_path(
        self,
        sum_logw: Tensor | None,
        evidence_leaves: Tensor | None = None,
        *,
        most_probable: bool = False,
        generator: torch.Generator | None = None,
        batch_size: int = 1,
        uniforms: Tensor | None = None,
    ) -> Tensor:
        """``(B, n)`` long: the input unit a latent path z ~ q(z | evidence) selects per position.
        ``evidence_leaves`` ``(B, m, r)``: log phi of the first m positions' units at their
        tokens; ``most_probable``: each sum unit takes its most probable child instead;
        ``uniforms`` ``(B, U)``: one per sum unit (a decoder's stream), else ``generator``'s."""
        n, r, U = self.window, self.rank, self.num_sum_units
        if sum_logw is not None:
            batch_size = sum_logw.shape[0]
            _check_shape(sum_logw, "sum_logw", (batch_size, U, r))
        elif U:
            raise ValueError(f"sum_logw must have shape (B, U={U}, r={r}), got None")
        ev = None
        if evidence_leaves is not None:
            ev = _f32(evidence_leaves)
            if ev.dim() != 3 or ev.shape[0] != batch_size or ev.shape[2] != r or ev.shape[1] > n:
                raise ValueError(
                    f"evidence_leaves must have shape (B={batch_size}, m<={n}, r={r}), "
                    f"got {tuple(ev.shape)}"
                )
        if sum_logw is None:  # no sum unit: one unit per position
            device = torch.device("cpu") if ev is None else ev.device
            return torch.zeros(batch_size, n, dtype=torch.long, device=device)
        lw = scores = _f32(sum_logw)  # the prior
        m = 0 if ev is None else ev.shape[1]
        if ev is not None and m and (plan := self._prefix_plan(m)) is not None:
            scores = self._prefix_posterior(plan, ev, lw)  # a short prefix: only its ancestors
        elif ev is not None and m:
            leaves = torch.cat([ev, ev.new_zeros(batch_size, n - m, r)], 1)  # (B, n, r)
            scores = self._posterior(leaves, lw, max_product=False)
        choice = scores.argmax(-1) if most_probable else categorical(scores, generator, uniforms)
        return self._walk_down(choice)  # (B, n)

    def _prefix_plan(self, span: int) -> tuple[_Step, ...] | None:
        """The folds that depend on the first ``span`` positions (the others are log 1),
        bottom-up, when that is cheaper than a layered pass; else None. Cached per span."""
        if span not in self._prefix_plans:
            steps: list[_Step] = []
            cost = 0
            for lid, la in enumerate(self.layers[1:], 1):
                for f, scope in enumerate(la.scopes):
                    if scope[0] >= span:  # scopes are sorted: no prefix position here
                        continue
                    kids = tuple(  # the children whose scope starts in the prefix (inputs too)
                        k for k in self._kids[(lid, f)] if self.layers[k[0]].scopes[k[1]][0] < span
                    )
                    lo = la.sum_offset + f * la.num_units
                    steps.append(_Step(la.kind == "sum", (lid, f), kids, lo, la.num_units))
                    cost += int(la.kind == "sum" or len(kids) > 1)
            self._prefix_plans[span] = tuple(steps) if cost < len(self.layers) else None
        return self._prefix_plans[span]

    def _prefix_values(
        self,
        plan: tuple[_Step, ...],
        inputs: dict[tuple[int, int], Tensor],
        lw: Tensor,
        scores: Tensor | None = None,
    ) -> Tensor:
        """Log-values of the prefix's folds, bottom-up; returns the root's ``(B, 1, K)``.
        ``inputs``: ``(0, position) -> (B or 1, r, 1 or K)``. ``scores`` ``(B, U, r)`` (K = 1):
        the rows of the prefix's sum units are overwritten with their child log-scores."""
        values = dict(inputs)
        fmin = torch.finfo(lw.dtype).min
        wexp = None if scores is not None else lw.exp()  # (B, U, r)
        for is_sum, fold, kids, lo, R in plan:
            c = values[kids[0]]  # (B, r, K)
            for k in kids[1:]:  # a Hadamard product adds its children's log-values
                c = c + values[k]
            if is_sum:
                if scores is not None:  # K = 1: the posterior's scores and log-sum-exp
                    s = lw[:, lo : lo + R] + c.transpose(1, 2)  # (B, R, r)
                    scores[:, lo : lo + R] = s
                    # s_0 - log_softmax(s)_0 = logsumexp(s) (s is finite here; 7x faster on
                    # these tiny rows than torch.logsumexp)
                    c = (s[..., 0] - torch.log_softmax(s, -1)[..., 0]).unsqueeze(-1)
                else:  # K columns, some -inf (unit vectors): log(W exp(c - max)) + max, (B, R, K)
                    mx = c.amax(1, keepdim=True).clamp_min(fmin)  # (B, 1, K)
                    assert wexp is not None
                    c = torch.matmul(wexp[:, lo : lo + R], torch.exp(c - mx)).log() + mx
            values[fold] = c
        return values[plan[-1].fold]  # the root: the last fold of a prefix's plan

    def _prefix_posterior(self, plan: tuple[_Step, ...], ev: Tensor, lw: Tensor) -> Tensor:
        """:meth:`_posterior` given ``ev`` ``(B, m, r)`` on a prefix (``plan``: its
        ``_prefix_plan(m)``): only the units above the prefix differ from their weights."""
        inputs = {(0, p): ev[:, p].unsqueeze(-1) for p in range(ev.shape[1])}
        scores = lw.to(torch.promote_types(lw.dtype, ev.dtype), copy=True)  # (B, U, r)
        self._prefix_values(plan, inputs, lw, scores)
        return scores

    def _posterior(self, leaves: Tensor, lw: Tensor, *, max_product: bool) -> Tensor:
        """Every sum unit's child log-scores ``(B, U, r)``: weight + the child's log-value under
        ``leaves`` (B, n, r) (sum-product: the child's posterior up to a constant; max-product:
        the best completion below it)."""
        B, r = lw.shape[0], self.rank
        sum_inputs = self._upward(leaves.unsqueeze(-1), lw, max_product=max_product)[1]
        pieces = []
        for layer, c in zip(self.layers, sum_inputs, strict=True):
            if c is not None:
                F, R, lo = layer.num_folds, layer.num_units, layer.sum_offset
                w = lw[:, lo : lo + F * R].view(B, F, R, r)
                pieces.append((w + c[..., 0].unsqueeze(2)).view(B, F * R, r))
        return torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]

    def _walk_down(self, choice: Tensor) -> Tensor:
        """``(B, n)`` input unit of each position on the induced tree of ``choice`` (B, U)."""
        device = choice.device
        units = torch.zeros(choice.shape[0], self.window, dtype=torch.long, device=device)
        for rows, has in self._walk:
            child = choice.gather(1, self._on(rows, device) + units)  # (B, n)
            units = child if has is None else torch.where(self._on(has, device), child, units)
        return units

    def _on(self, t: Tensor, device: torch.device) -> Tensor:
        """A cached copy of a structure index tensor on ``device``."""
        if t.device == device:
            return t
        key = (id(t), device)
        if key not in self._device_cache:
            self._device_cache[key] = t.to(device)
        return self._device_cache[key]

    def _read(self, outs: list[Tensor], slot: Slot) -> Tensor:
        """Gather the children of one slot: ``(B, F, R, K)``."""
        if slot.start is not None:  # consecutive folds of one layer
            return outs[slot.sources[0]].narrow(1, slot.start, slot.index.shape[0])
        srcs = [outs[s] for s in slot.sources]
        src = srcs[0] if len(srcs) == 1 else torch.cat(srcs, 1)
        return src.index_select(1, self._on(slot.index, src.device))

    def _leaves(
        self, params: CircuitParams, x: Tensor, mask: Tensor | None, name: str
    ) -> tuple[Tensor, Tensor | None]:
        """log phi at full windows ``x`` ``(B, n)``: ``(B, n, r)``, 0 where ``mask`` (named
        ``name`` in errors) is False; and the sum log-weights."""
        lp, lw = self._unpack(params)
        if mask is not None:
            _check_shape(mask, name, (lp.shape[0], self.window))
            x = torch.where(mask, x, 0) if x.shape == mask.shape else x
        self._check_tokens(x, "x", lp, exact=True)
        leaves = leaf_values(lp, x)  # (B, n, r)
        if mask is not None:
            leaves = leaves.masked_fill(~mask.unsqueeze(-1), 0.0)
        return leaves, lw

    def _unpack(self, params: CircuitParams) -> tuple[Tensor, Tensor | None]:
        if not isinstance(params, CircuitParams):
            raise ValueError(f"params must be a CircuitParams, got {type(params).__name__}")
        lp = _f32(params.input_logp)
        n, r = self.window, self.rank
        if lp.dim() != 4 or lp.shape[1] != n or lp.shape[2] != r:
            raise ValueError(
                f"params.input_logp must have shape (B, n={n}, r={r}, V), got {tuple(lp.shape)}"
            )
        U, lw = self.num_sum_units, params.sum_logw
        if U == 0:
            return lp, None
        if lw is None or lw.shape != (lp.shape[0], U, r):
            got = None if lw is None else tuple(lw.shape)
            raise ValueError(
                f"params.sum_logw must have shape (B={lp.shape[0]}, U={U}, r={r}), got {got}"
            )
        return lp, _f32(lw)

    def _check_tokens(self, x: Tensor, name: str, lp: Tensor, *, exact: bool) -> None:
        B, n, _, V = lp.shape
        if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor of token ids")
        if x.dim() != 2 or x.shape[0] != B or (exact and x.shape[1] != n):
            want = f"(B={B}, n={n})" if exact else f"(B={B}, m<={n})"
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
        check_ids(x, V, f"{name} holds", f" (vocab_size={V})")

    def _check_evidence(self, ev: Tensor | None, lp: Tensor, *, name: str, max_len: int) -> int:
        if ev is None:
            return 0
        if isinstance(ev, Tensor) and ev.dim() == 2 and ev.shape[1] > max_len:
            raise ValueError(
                f"{name} has {ev.shape[1]} positions but must have at most {max_len} "
                f"(window={self.window})"
            )
        self._check_tokens(ev, name, lp, exact=False)
        return int(ev.shape[1])


def leaf_values(lp: Tensor, x: Tensor) -> Tensor:
    """log phi at tokens: ``lp (B, n, r, V)``, ``x (B, m)`` -> ``(B, m, r)``."""
    idx = x[:, :, None, None].expand(*x.shape, lp.shape[2], 1)  # (B, m, r, 1)
    return lp[:, : x.shape[1]].gather(3, idx).squeeze(3)


def _check_shape(t: Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_ids(ids: Tensor, vocab_size: int, who: str, where: str) -> None:
    """ValueError ``"{who} token ids outside [0, V - 1]{where}: min .., max .."`` for one."""
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= vocab_size:
            raise ValueError(
                f"{who} token ids outside [0, {vocab_size - 1}]{where}: "
                f"min {int(lo)}, max {int(hi)}"
            )


def categorical(
    logits: Tensor, generator: torch.Generator | None = None, u: Tensor | None = None
) -> Tensor:
    """One draw per row of unnormalised log-probabilities ``(..., C)`` by inverse CDF, with
    the uniforms ``u`` ``(...,)`` (a decoder's stream) or fresh ones from ``generator``.
    One uniform per row (Gumbel-max needs one per entry: several times slower on CPU)."""
    probs = torch.softmax(logits, -1)  # (..., C)
    if u is None:
        u = torch.rand(
            probs.shape[:-1], generator=generator, device=probs.device, dtype=probs.dtype
        )
    return inverse_cdf(probs, u)


def inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """The entry of each row of nonnegative ``weights`` ``(..., C)`` (not necessarily
    normalised) where the cumulative sum first exceeds ``u`` ``(...,)`` in [0, 1) of the row's
    total, summed in ``u``'s dtype: an entry of zero weight is never chosen."""
    cdf = weights.to(u.dtype).cumsum(-1)  # (..., C)
    total = cdf[..., -1:]
    x = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, x, right=True)  # (..., 1)
    return idx.squeeze(-1).clamp_max(cdf.shape[-1] - 1)
