"""Contextual circuit parameters: one set of normalised parameters per batch row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class CircuitParams:
    """Normalised, per-example parameters of a circuit (the head's output theta_t)."""

    input_logp: Tensor  # (B, n, r, V) input units' log-probabilities, normalised over V
    sum_logw: Tensor | None = None  # (B, U, r) row u: sum unit u's log-weights; None for ff

    @classmethod
    def from_logits(cls, input_logits: Tensor, sum_logits: Tensor | None = None) -> CircuitParams:
        """Normalise logits ``(B, n, r, V)`` and ``(B, U, r)`` or None (half precision: in fp32)."""
        lp = torch.log_softmax(_f32(input_logits), dim=-1)
        lw = None if sum_logits is None else torch.log_softmax(_f32(sum_logits), dim=-1)
        return cls(lp, lw)

    @property
    def batch_size(self) -> int:
        return self.input_logp.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.input_logp.dtype

    def __getitem__(self, index: int | slice | Tensor) -> CircuitParams:
        """Select batch rows (an int keeps the batch dim: ``params[3]`` has B = 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return self.apply(lambda t: t[index])

    def to(self, *args: object, **kwargs: object) -> CircuitParams:
        """``Tensor.to`` applied to every tensor (dtype and/or device)."""
        return self.apply(lambda t: t.to(*args, **kwargs))  # type: ignore[call-overload]

    def expand(self, rows: int) -> CircuitParams:
        """One example's parameters (B = 1) repeated ``rows`` times (views, no copies)."""
        return self.apply(lambda t: t.expand(rows, *t.shape[1:]))

    def apply(self, fn: Callable[[Tensor], Tensor]) -> CircuitParams:
        """``fn`` applied to every tensor."""
        lw = self.sum_logw
        return CircuitParams(fn(self.input_logp), None if lw is None else fn(lw))

    @staticmethod
    def cat(params: list[CircuitParams]) -> CircuitParams:
        """Concatenate along the batch dimension."""
        lp = torch.cat([p.input_logp for p in params])
        lws = [p.sum_logw for p in params]
        lw = None if lws[0] is None else torch.cat([w for w in lws if w is not None])
        return CircuitParams(lp, lw)


def _f32(t: Tensor) -> Tensor:
    """Upcast half precision to fp32; leave fp32/fp64 alone."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def exact_sums(device: torch.device) -> torch.autocast:
    """Autocast off on ``device``: under a mixed-precision trainer (``bf16-mixed``) the
    circuit's sums and products run in their inputs' float32, not bf16 (its matmuls of
    probabilities would keep 8 bits each; they are small: autocast's gain is the input
    projection, which stays outside)."""
    return torch.autocast(device.type, enabled=False)
