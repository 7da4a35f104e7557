"""MTPC head: contextual features e_t -> circuit parameters theta_t (paper Sec. 3.3).

The head holds the unembedding tensor ``W`` in ``R^{n x r x V x d}`` (input units) and the
sum-unit projections ``R`` (one row of r logits per sum unit, plus a bias that carries the
identity initialisation of HMM transitions). ``head(e)`` returns a
:class:`~mtpc.circuits.CircuitParams` that every query of ``head.circuit`` takes.

Training uses :func:`chunked_log_likelihood`: it never holds the ``(T, n, r, V)`` logits of a
whole batch, only those of one chunk, recomputed in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from mtpc.choices import EXTRA_POSITIONS
from mtpc.circuits import Circuit, CircuitParams, build_structure
from mtpc.circuits.structure import check_kind_window_rank

__all__ = ["EXTRA_POSITIONS", "MTPCHead", "chunked_log_likelihood"]


class MTPCHead(nn.Module):
    """Circuit head over a window of ``window`` tokens.

    Args:
        kind: Circuit family: ``"ff"``, ``"cp"``, ``"hmm"`` or ``"btree"``.
        window: Window length n >= 1.
        rank: Units per region r >= 1 (must be 1 for ``ff``).
        vocab_size: Vocabulary size V.
        hidden_size: Feature size d of the embeddings e_t.
        homogeneous: HMM only: one transition matrix shared by all steps (ablation).
        contextual_transitions: HMM only: transitions depend on e_t (False: a learned bias
            only, the non-contextual ablation).
        identity_init: HMM and BTree: initialise the r x r sums (HMM transitions, BTree's
            inner regions) at (near) identity through the bias, so unit j of a region
            starts as unit j of its inputs (BTree then starts as a CP; the root stays
            uniform or random).
        identity_logit: Bias on the diagonal of identity-initialised sums
            (weight ``1 / (1 + (r - 1) exp(-identity_logit))`` on the diagonal).
        init_std: Std of the random normal initialisation of ``W``.
        sum_init_std: Std of the random normal initialisation of the contextual sum-unit
            projections ``R`` (0: uniform sums everywhere). Random ``R`` keeps the exact
            step-0 equality with FF (units start identical, so any sum weights give FF's
            distribution) but makes each unit's weight depend on the context, so the
            identical units get different gradients and separate (docs/CIRCUITS.md).
        extra_positions: What :meth:`from_pretrained_unembeddings` gives window positions
            past the m pretrained heads (n = 16 on EvaByte's 8): ``"random"``
            (``N(0, init_std^2)``, shared by the units of a position so the start stays FF;
            the default, as the paper's reference code, and measured better) or
            ``"repeat_last"`` (copy head m).

    Raises:
        ValueError: For an invalid kind, window, rank, vocab_size or hidden_size, or HMM
            options given to another family.
    """

    def __init__(
        self,
        kind: str,
        window: int,
        rank: int,
        vocab_size: int,
        hidden_size: int,
        *,
        homogeneous: bool = False,
        contextual_transitions: bool = True,
        identity_init: bool = True,
        identity_logit: float = 10.0,
        init_std: float = 0.02,
        sum_init_std: float = 0.02,
        extra_positions: str = "random",
    ) -> None:
        super().__init__()
        check_kind_window_rank(kind, window, rank)
        for name, val in (("vocab_size", vocab_size), ("hidden_size", hidden_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
        options: dict[str, object] = {}
        if kind == "hmm":
            options = {
                "homogeneous": homogeneous,
                "contextual": contextual_transitions,
                "identity": identity_init,
            }
        elif homogeneous or not contextual_transitions:
            raise ValueError(
                "homogeneous / contextual_transitions are options of kind='hmm' only, "
                f"got kind={kind!r}"
            )
        elif kind == "btree":
            options = {"identity": identity_init}
        self.kind, self.window, self.rank = kind, window, rank
        self.homogeneous, self.contextual_transitions = homogeneous, contextual_transitions
        self.identity_init = identity_init
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.identity_logit = float(identity_logit)
        numeric = not isinstance(sum_init_std, bool) and isinstance(sum_init_std, int | float)
        if not (numeric and sum_init_std >= 0):  # also refuses NaN
            raise ValueError(f"sum_init_std must be a number >= 0, got {sum_init_std!r}")
        self.sum_init_std = float(sum_init_std)
        if extra_positions not in EXTRA_POSITIONS:
            raise ValueError(
                f"extra_positions must be one of {list(EXTRA_POSITIONS)}, got {extra_positions!r}"
            )
        self.extra_positions = extra_positions
        self.init_std = float(init_std)
        self.structure = build_structure(kind, window, rank, **options)
        self.circuit = Circuit(self.structure)
        s = self.structure
        # (n, r, V, d): one matmul gives the (B, n, r, V) input logits
        self.unembedding = nn.Parameter(
            torch.randn(window, rank, vocab_size, hidden_size) * init_std
        )
        ctx_rows = s.param_contextual.nonzero().flatten()
        self._ctx_rows: Tensor
        self._sum_tie: Tensor
        self.register_buffer("_ctx_rows", ctx_rows, persistent=False)
        self.register_buffer("_sum_tie", s.sum_tie.clone(), persistent=False)
        self._tied = not torch.equal(s.sum_tie, torch.arange(s.num_sum_rows))
        self._all_ctx = ctx_rows.numel() == s.num_param_rows
        # (P_ctx * r, d): sum-unit projections R (random: context-dependent sums; zero: uniform)
        self.sum_proj = nn.Parameter(torch.zeros(ctx_rows.numel() * rank, hidden_size))
        self.sum_bias = nn.Parameter(torch.zeros(s.num_param_rows, rank))  # (P, r)
        # FF has no sums: its (0, d) / (0, r) tensors stay (exported drafts keep their names)
        # but are frozen, since a trainable parameter that never gets a gradient stalls
        # DDP's gradient reduction ("Expected to have finished reduction") and is dead
        # weight for the optimizer
        for param in (self.sum_proj, self.sum_bias):
            param.requires_grad_(param.numel() > 0)
        self.reset_sum_parameters()

    def structure_options(self) -> dict[str, bool]:
        """Options that change the parameter shapes (needed to rebuild the head)."""
        return {
            "homogeneous": self.homogeneous,
            "contextual_transitions": self.contextual_transitions,
        }

    def init_options(self) -> dict[str, object]:
        """How the head was initialised (recorded with exported drafts)."""
        return {
            "init_std": self.init_std,
            "sum_init_std": self.sum_init_std,
            "identity_init": self.identity_init,
            "identity_logit": self.identity_logit,
            "extra_positions": self.extra_positions,
        }

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind!r}, window={self.window}, rank={self.rank}, "
            f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}"
        )

    @property
    def num_sum_units(self) -> int:
        """Number of sum units U of the circuit."""
        return self.structure.num_sum_rows

    @torch.no_grad()
    def reset_sum_parameters(self) -> None:
        """Random projections ``R ~ N(0, sum_init_std^2)``, zero bias, identity transitions.

        With ``sum_init_std = 0`` every sum starts uniform. Bias-only rows (the non-contextual
        HMM transitions) start at the identity or uniform either way: they are broken out of
        symmetry by the contextual root sum above them.
        """
        if self.sum_init_std > 0:
            self.sum_proj.normal_(0.0, self.sum_init_std)
        else:
            self.sum_proj.zero_()
        self.sum_bias.zero_()
        s = self.structure
        rows = s.param_identity.nonzero().flatten()
        if rows.numel():
            self.sum_bias[rows, s.param_unit[rows]] = self.identity_logit

    @torch.no_grad()
    def from_pretrained_unembeddings(
        self, unembeddings: Tensor, noise_std: float = 0.0, generator: torch.Generator | None = None
    ) -> MTPCHead:
        """Initialise from pretrained (MTP or STP) unembeddings.

        ``W[i, j] = U[i]`` for every unit j, and for positions ``i >= m`` past the pretrained
        heads ``U[m - 1]`` or a random matrix (``extra_positions``) shared by the units;
        sum projections drawn anew (:meth:`reset_sum_parameters`). The units of a region are
        identical, so every family starts with exactly FF's distribution.

        Args:
            unembeddings: ``(m, V, d)`` (m pretrained heads) or ``(V, d)`` (one STP head).
            noise_std: Std of Gaussian noise added to W to break the symmetry between units
                (0 keeps the exact FF equivalence).
            generator: Optional generator for the noise.

        Returns:
            ``self``.
        """
        u = unembeddings
        if u.dim() == 2:
            u = u.unsqueeze(0)
        V, d = self.vocab_size, self.hidden_size
        if u.dim() != 3 or u.shape[1:] != (V, d):
            raise ValueError(
                f"unembeddings must have shape (m, V={V}, d={d}) or (V, d), "
                f"got {tuple(unembeddings.shape)}"
            )
        m = u.shape[0]
        idx = torch.arange(self.window).clamp_max(m - 1)
        w = u.to(self.unembedding)[idx.to(u.device)]  # (n, V, d)
        if self.extra_positions == "random" and self.window > m:
            w[m:] = torch.randn_like(w[m:]) * self.init_std
        self.unembedding.copy_(w.unsqueeze(1).expand_as(self.unembedding))
        if noise_std > 0:
            noise = torch.randn(
                self.unembedding.shape, generator=generator, device=self.unembedding.device
            )
            self.unembedding.add_(noise.to(self.unembedding) * noise_std)
        self.reset_sum_parameters()
        return self

    def _check_hidden(self, e: Tensor) -> None:
        if not isinstance(e, Tensor) or e.dim() != 2 or e.shape[1] != self.hidden_size:
            got = tuple(e.shape) if isinstance(e, Tensor) else type(e).__name__
            raise ValueError(f"e must have shape (B, hidden_size={self.hidden_size}), got {got}")

    def input_logits(
        self,
        e: Tensor,
        positions: Tensor | list[int] | None = None,
        units: Tensor | list[int] | None = None,
    ) -> Tensor:
        """Unnormalised input logits, the whole table or only the rows of W asked for.

        Args:
            e: Features ``(B, d)``.
            positions: Optional window positions to compute (others skipped).
            units: Optional units, one per entry of ``positions`` (needs ``positions``): only
                the ``(position, unit)`` pairs are computed, ``len(positions)`` rows of
                ``V x d`` weights instead of ``n r`` (a latent path's leaves).

        Returns:
            ``(B, n, r, V)``; ``(B, len(positions), r, V)`` with ``positions``;
            ``(B, len(positions), V)`` with ``positions`` and ``units``.
        """
        self._check_hidden(e)
        if units is None:
            w = self.unembedding if positions is None else _rows(self.unembedding, positions)
            logits = F.linear(e.to(w.dtype), w.reshape(-1, self.hidden_size))  # (B, n * r * V)
            return logits.view(e.shape[0], w.shape[0], self.rank, self.vocab_size)
        pos = torch.as_tensor(positions if positions is not None else [], dtype=torch.long)
        unit = torch.as_tensor(units, dtype=torch.long)
        if positions is None or pos.dim() != 1 or unit.shape != pos.shape:
            raise ValueError(
                "units needs positions of the same length (one unit per position), got "
                f"positions={None if positions is None else tuple(pos.shape)}, "
                f"units={tuple(unit.shape)}"
            )
        W, B, k = self.unembedding, e.shape[0], pos.shape[0]
        x = e.to(W.dtype)
        pairs = list(zip(pos.tolist(), unit.tolist(), strict=True))
        if not pairs:
            return x.new_zeros(B, 0, self.vocab_size)
        if self.rank == 1:  # ff: the rows of the positions (a view when consecutive)
            w = _rows(W[:, 0], [p for p, _ in pairs])  # (k, V, d)
            return F.linear(x, w.reshape(-1, self.hidden_size)).view(B, k, self.vocab_size)
        # one (V, d) row of W at a time, read in place (indexing W would first copy the rows)
        return torch.stack([F.linear(x, W[p, u]) for p, u in pairs], 1)  # (B, k, V)

    def token_logits(self, e: Tensor, positions: Tensor, tokens: Tensor) -> Tensor:
        """Unnormalised input logits of every unit at given (position, token) pairs.

        Reads the r d-vectors ``W[p, :, x_p]`` per pair, not the r ``(V, d)`` rows, so it
        gives no normaliser: enough to score units against each other when their
        normalisers are ignored (the greedy ``zmap`` draft's pending token).

        Args:
            e: Features ``(B, d)``.
            positions: ``(k,)`` window positions.
            tokens: ``(k,)`` one token per position.

        Returns:
            ``(B, k, r)``.
        """
        self._check_hidden(e)
        if positions.shape != tokens.shape or positions.dim() != 1:
            raise ValueError(
                "positions and tokens must be 1-D of the same length, got "
                f"{tuple(positions.shape)} and {tuple(tokens.shape)}"
            )
        w = self.unembedding[positions, :, tokens]  # (k, r, d)
        k = w.shape[0]
        logits = F.linear(e.to(w.dtype), w.reshape(k * self.rank, self.hidden_size))
        return logits.view(e.shape[0], k, self.rank)  # (B, k, r)

    def sum_logits(self, e: Tensor) -> Tensor | None:
        """Unnormalised sum-unit logits ``(B, U, r)`` (None for ff)."""
        s = self.structure
        if s.num_sum_rows == 0:
            return None
        B, P, r = e.shape[0], s.num_param_rows, self.rank
        bias = self.sum_bias
        if self._ctx_rows.numel():
            z = F.linear(e.to(self.sum_proj.dtype), self.sum_proj).view(B, -1, r)  # (B, Pc, r)
            z = z + bias if self._all_ctx else bias.expand(B, P, r).index_add(1, self._ctx_rows, z)
        else:
            z = bias.expand(B, P, r)
        if self._tied:
            z = z.index_select(1, self._sum_tie)  # (B, U, r)
        return z

    def forward(self, e: Tensor) -> CircuitParams:
        """Circuit parameters theta_t for features ``e`` ``(B, d)``."""
        return CircuitParams.from_logits(self.input_logits(e), self.sum_logits(e))

    def sum_log_weights(self, e: Tensor) -> Tensor | None:
        """Normalised sum log-weights ``(B, U, r)`` in fp32 or fp64 (None for ff)."""
        z = self.sum_logits(e)
        if z is None:
            return None
        return torch.log_softmax(z.float() if z.dtype in (torch.float16, torch.bfloat16) else z, -1)

    def leaf_log_prob(self, e: Tensor, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """log phi at the tokens without building the normalised (B, n, r, V) tensor twice.

        Args:
            e: ``(B, d)``.
            x: Tokens ``(B, n)``.
            mask: Optional ``(B, n)`` bool; False positions get 0 (marginalised).

        Returns:
            ``(B, n, r)``.
        """
        logits = self.input_logits(e)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if mask is not None:
            x = torch.where(mask, x, 0)
        B, n, r, _ = logits.shape
        picked = logits.gather(3, x[:, :, None, None].expand(B, n, r, 1)).squeeze(3)
        leaves = picked - logits.logsumexp(3)  # (B, n, r)
        if mask is not None:
            leaves = leaves.masked_fill(~mask.unsqueeze(-1), 0.0)
        return leaves

    def chunked_log_likelihood(
        self,
        hidden: Tensor,
        targets: Tensor,
        mask: Tensor | None = None,
        *,
        chunk_size: int = 1024,
        checkpoint: bool = True,
    ) -> Tensor:
        """See :func:`chunked_log_likelihood`."""
        return chunked_log_likelihood(
            self, hidden, targets, mask, chunk_size=chunk_size, checkpoint=checkpoint
        )


def chunked_log_likelihood(
    head: MTPCHead,
    hidden: Tensor,
    targets: Tensor,
    mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    checkpoint: bool = True,
) -> Tensor:
    """Memory-lean prefix log-likelihoods of the target windows.

    Runs the head and the circuit on chunks of ``chunk_size`` rows; with ``checkpoint`` the
    chunk's activations (its ``(chunk, n, r, V)`` logits) are freed after the forward pass
    and recomputed in backward, so peak memory grows with the chunk, not with T.

    Args:
        head: The MTPC head.
        hidden: Features ``(T, d)``.
        targets: Target windows ``(T, n)`` (``targets[t, i]`` = token t + i + 1).
        mask: Optional ``(T, n)`` bool validity; invalid positions are marginalised (their
            ids are not checked, e.g. -100 padding).
        chunk_size: Rows per chunk.
        checkpoint: Recompute activations in backward (only when grad is enabled).

    Returns:
        ``(T, n)``: column i is ``log q(x_1..x_{i+1})``; the per-position conditional is the
        difference of consecutive columns, the full-window ``log q`` is the last column.
    """
    T, n = targets.shape[0], head.window
    if hidden.dim() != 2 or hidden.shape[1] != head.hidden_size:
        raise ValueError(
            f"hidden must have shape (T, hidden_size={head.hidden_size}), got {tuple(hidden.shape)}"
        )
    if targets.dim() != 2 or targets.shape != (hidden.shape[0], n):
        raise ValueError(
            f"targets must have shape (T={hidden.shape[0]}, window={n}), got {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of token ids")
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool tensor of shape {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    valid = targets if mask is None else targets[mask]
    if valid.numel():
        lo, hi = torch.aminmax(valid)
        if int(lo) < 0 or int(hi) >= head.vocab_size:
            raise ValueError(
                f"targets hold token ids outside [0, {head.vocab_size - 1}] where valid: "
                f"min {int(lo)}, max {int(hi)}"
            )

    def chunk(h: Tensor, x: Tensor, m: Tensor | None) -> Tensor:
        leaves = head.leaf_log_prob(h, x, m)  # (C, n, r)
        return head.circuit.prefix_from_leaves(leaves, head.sum_log_weights(h))  # (C, n)

    outs = []
    use_ckpt = checkpoint and torch.is_grad_enabled()
    for s in range(0, T, chunk_size):
        h, x = hidden[s : s + chunk_size], targets[s : s + chunk_size]
        m = None if mask is None else mask[s : s + chunk_size]
        if use_ckpt:
            outs.append(_checkpoint(chunk, h, x, m, use_reentrant=False))
        else:
            outs.append(chunk(h, x, m))
    if not outs:
        return hidden.new_zeros(0, n, dtype=torch.float32)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _rows(w: Tensor, index: Tensor | list[int]) -> Tensor:
    """``w[index]`` along dim 0; a view, not a copy, when the index is a consecutive range."""
    idx = index.tolist() if isinstance(index, Tensor) else list(index)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return w[idx[0] : idx[0] + len(idx)]
    return w[index]
