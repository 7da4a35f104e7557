"""MTPC head: contextual features e_t -> circuit parameters theta_t (paper Sec. 3.3); see
docs/CIRCUITS.md, "Head" and "Initialisation"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from mtpc.choices import EXTRA_POSITIONS
from mtpc.circuits import Circuit, CircuitParams, build_structure
from mtpc.circuits.engine import check_ids, leaf_values
from mtpc.circuits.params import _f32, exact_sums

__all__ = ["EXTRA_POSITIONS", "MTPCHead", "chunked_log_likelihood"]


class MTPCHead(nn.Module):
    """Circuit head over a window of ``window`` tokens (options: docs/CIRCUITS.md, "Head");
    ``identity_logit``: the diagonal bias of identity-initialised sums (weight
    ``1 / (1 + (r - 1) exp(-identity_logit))`` on the diagonal)."""

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
        options: dict[str, object] = {"identity": identity_init} if kind in ("hmm", "btree") else {}
        if kind == "hmm":
            options |= {"homogeneous": homogeneous, "contextual": contextual_transitions}
        s = self.structure = build_structure(kind, window, rank, **options)  # checks those three
        for name, val in (("vocab_size", vocab_size), ("hidden_size", hidden_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
        if kind != "hmm" and (homogeneous or not contextual_transitions):
            raise ValueError(
                "homogeneous / contextual_transitions are options of kind='hmm' only, "
                f"got kind={kind!r}"
            )
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
        self.circuit = Circuit(s)
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
        # FF has no sums: its (0, d) / (0, r) tensors keep their names in exported drafts but
        # are frozen (a parameter that never gets a gradient stalls DDP's gradient reduction)
        for param in (self.sum_proj, self.sum_bias):
            param.requires_grad_(param.numel() > 0)
        self.reset_sum_parameters()

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

    @torch.no_grad()
    def reset_sum_parameters(self) -> None:
        """Random projections ``R ~ N(0, sum_init_std^2)``, zero bias, identity transitions."""
        if self.sum_init_std > 0:
            self.sum_proj.normal_(0.0, self.sum_init_std)
        else:
            self.sum_proj.zero_()
        self.sum_bias.zero_()
        s = self.structure
        rows = s.param_identity.nonzero().flatten()  # (P_id,), maybe empty
        self.sum_bias[rows, s.param_unit[rows]] = self.identity_logit

    @torch.no_grad()
    def from_pretrained_unembeddings(
        self, unembeddings: Tensor, noise_std: float = 0.0, generator: torch.Generator | None = None
    ) -> MTPCHead:
        """Initialise W from ``(m, V, d)`` or ``(V, d)`` unembeddings: an exact FF start."""
        u = unembeddings.unsqueeze(0) if unembeddings.dim() == 2 else unembeddings
        V, d = self.vocab_size, self.hidden_size
        if u.dim() != 3 or u.shape[1:] != (V, d):
            raise ValueError(
                f"unembeddings must have shape (m, V={V}, d={d}) or (V, d), "
                f"got {tuple(unembeddings.shape)}"
            )
        m, W = u.shape[0], self.unembedding
        idx = torch.arange(self.window).clamp_max(m - 1)
        w = u.to(W)[idx.to(u.device)]  # (n, V, d)
        if self.extra_positions == "random" and self.window > m:
            w[m:] = torch.randn_like(w[m:]) * self.init_std
        W.copy_(w.unsqueeze(1).expand_as(W))
        if noise_std > 0:
            noise = torch.randn(W.shape, generator=generator, device=W.device)
            W.add_(noise.to(W) * noise_std)
        self.reset_sum_parameters()
        return self

    def _check_hidden(self, e: Tensor, name: str = "e", rows: str = "B") -> None:
        if not isinstance(e, Tensor) or e.dim() != 2 or e.shape[1] != self.hidden_size:
            got = tuple(e.shape) if isinstance(e, Tensor) else type(e).__name__
            want = f"({rows}, hidden_size={self.hidden_size})"
            raise ValueError(f"{name} must have shape {want}, got {got}")

    def input_logits(
        self,
        e: Tensor,
        positions: Tensor | list[int] | None = None,
        units: Tensor | list[int] | None = None,
    ) -> Tensor:
        """Unnormalised input logits of ``e`` ``(B, d)``: ``(B, n, r, V)``; with ``positions``:
        ``(B, k, r, V)``; with one unit per position too: ``(B, k, V)``, only those
        ``(position, unit)`` rows of W (a latent path's leaves)."""
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
        """``(B, k, r)`` unnormalised logits of every unit at ``(k,)`` (position, token) pairs:
        only the r d-vectors ``W[p, :, x_p]`` per pair are read, so no normaliser."""
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
        return None if z is None else torch.log_softmax(_f32(z), -1)

    def leaf_log_prob(self, e: Tensor, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(B, n, r)`` log phi at tokens ``x`` ``(B, n)``; 0 where ``mask`` is False."""
        logits = _f32(self.input_logits(e))
        if mask is not None:
            x = torch.where(mask, x, 0)
        leaves = leaf_values(logits, x) - logits.logsumexp(3)  # (B, n, r)
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
        """``(T, n)`` prefix log-likelihoods of ``targets`` ``(T, n)`` given ``hidden`` ``(T, d)``;
        ``mask`` False positions are summed out (ids unchecked). Only one chunk's logits exist
        at a time (recomputed in backward with ``checkpoint``)."""
        T, n = targets.shape[0], self.window
        self._check_hidden(hidden, "hidden", "T")
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
        check_ids(valid, self.vocab_size, "targets hold", " where valid")

        def chunk(h: Tensor, x: Tensor, m: Tensor | None) -> Tensor:
            leaves, sum_logw = self.leaf_log_prob(h, x, m), self.sum_log_weights(h)  # fp32
            with exact_sums(h.device):
                return self.circuit.prefix_from_leaves(leaves, sum_logw)  # (C, n)

        outs = []
        use_ckpt = checkpoint and torch.is_grad_enabled()
        for s in range(0, T, chunk_size):
            h, x = hidden[s : s + chunk_size], targets[s : s + chunk_size]
            m = None if mask is None else mask[s : s + chunk_size]
            out = _checkpoint(chunk, h, x, m, use_reentrant=False) if use_ckpt else chunk(h, x, m)
            outs.append(out)
        if not outs:
            return hidden.new_zeros(0, n, dtype=torch.float32)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


# chunked_log_likelihood(head, hidden, targets, ...): the method, called as a function
chunked_log_likelihood = MTPCHead.chunked_log_likelihood


def _rows(w: Tensor, index: Tensor | list[int]) -> Tensor:
    """``w[index]`` along dim 0; a view, not a copy, when the index is a consecutive range."""
    idx = index.tolist() if isinstance(index, Tensor) else list(index)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return w[idx[0] : idx[0] + len(idx)]
    return w[index]
