"""Expressive heads leave FF: symmetry breaking of the FF-equivalent start (issue 11).

The toy where FF is provably limited: one context, whose two continuations ``aaaa`` and
``bbbb`` are equally likely. FF's best NLL per window is ``n log 2`` (each position 50/50,
independent); a mixture of two units reaches ``log 2``. The context's features vary from
row to row around one vector, as an LLM's hidden states of similar contexts do. Every head
starts from the same "pretrained" unembeddings, so at step 0 it equals FF exactly; it is
then trained with the optimiser of the composed default config (``python train.py``).
A head whose units never separate (the zero-initialised sum projections of the past)
stays at FF's best and fails here (cp, btree). The HMM's near-identity transitions let
float32 rounding noise, amplified by Adam, break the tie of the old start at random (about
half the seeds), so for HMM the step-0 gradient test is the one the old start fails.
Which runs escape FF's saddle depends on the data seed and on the CPU's rounding: over
training seeds 0-5 the default start gets below ``FF's best - 1`` (to ~0.72, the mixture's
best being log 2) on 4/6 seeds for cp, btree and the non-contextual HMM and 6/6 for hmm on
one 2-core AMD EPYC VM, and on 3/3 (cp, non-contextual HMM) and 2/3 (hmm, btree) of seeds
0-2 on another machine; the rest stay at FF's 2.79. So the test asks for at least 2 of 6
seeds (a mixture that never separates escapes on none); see docs/CIRCUITS.md.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from mtpc.heads import MTPCHead

V, D, N, R = 8, 16, 4, 4
FEATURE_NOISE = 0.5  # std of the row-to-row variation of the context's features
FF_BEST = N * math.log(2)  # per window
MIXTURE_BEST = math.log(2)
SEED = 1
ROOT = Path(__file__).resolve().parents[1]


def toy_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The context's feature vector (D,), its two windows (2, N), pretrained (N, V, D)."""
    g = torch.Generator().manual_seed(1)
    context = torch.randn(D, generator=g)
    context = context / context.norm() * math.sqrt(D)  # like an RMS-normed hidden state
    a, b = torch.randperm(V, generator=g)[:2].tolist()
    windows = torch.tensor([[a] * N, [b] * N])  # (2, N): aaaa, bbbb
    pretrained = torch.randn(N, V, D, generator=g) * 0.02  # (N, V, D)
    return context, windows, pretrained


def exact_nll(head: MTPCHead) -> float:
    """The expected NLL of the toy distribution (each window 1/2) at the context itself."""
    context, windows, _ = toy_problem()
    with torch.no_grad():
        params = head(context.expand(2, D))
        return -head.circuit.log_prob(params, windows).mean().item()


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimiser ``python train.py`` builds (``optimizer`` of the composed default)."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train")
    return instantiate(cfg.optimizer)(params)


def train(head: MTPCHead, steps: int, seed: int = SEED) -> None:
    context, windows, _ = toy_problem()
    opt = default_optimizer(list(head.parameters()))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        features = context + FEATURE_NOISE * torch.randn(64, D, generator=g)  # (64, D)
        mode = torch.randint(2, (64,), generator=g)
        loss = -head.circuit.log_prob(head(features), windows[mode]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def unit_spread(head: MTPCHead) -> float:
    """max over units a of |W[:, a] - W[:, 0]| (0: every unit is the same)."""
    w = head.unembedding.detach()
    return (w - w[:, :1]).abs().max().item()


def pretrained_head(kind: str, rank: int = R, **options: object) -> MTPCHead:
    torch.manual_seed(SEED)
    _, _, pretrained = toy_problem()
    head = MTPCHead(kind, N, rank, V, D, **options)  # type: ignore[arg-type]
    return head.from_pretrained_unembeddings(pretrained)


@pytest.mark.parametrize("kind", ["cp", "hmm", "btree"])
def test_step0_equals_ff_exactly(kind: str) -> None:
    """With random sum projections the start is still FF, on every window of V^N."""
    context, _, _ = toy_problem()
    ff, head = pretrained_head("ff", 1), pretrained_head(kind)
    assert head.sum_proj.abs().max() > 0  # the sums are context-dependent from step 0
    x = torch.tensor(list(itertools.product(range(V), repeat=N)))  # (V^N, N)
    features = context + FEATURE_NOISE * torch.randn(3, D)
    for e in features:
        e_rows = e.expand(x.shape[0], D)
        torch.testing.assert_close(
            head.circuit.log_prob(head(e_rows), x), ff.circuit.log_prob(ff(e_rows), x)
        )


@pytest.mark.parametrize(
    ("kind", "options"),
    [("cp", {}), ("hmm", {}), ("btree", {}), ("hmm", {"contextual_transitions": False})],
)
@pytest.mark.slow
def test_mixture_beats_ff_best_on_bimodal_windows(kind: str, options: dict[str, bool]) -> None:
    """From the FF start, the default optimiser takes the mixture well below FF's best (on at
    least 2 of 6 training seeds: escaping the saddle is random, never escaping is the bug)."""
    escaped = []
    for seed in range(6):
        head = pretrained_head(kind, **options)
        assert exact_nll(head) > FF_BEST  # the pretrained start is no better than FF
        train(head, steps=300, seed=seed)  # the embedded default's budget
        nll = exact_nll(head)
        if nll < FF_BEST - 1.0:
            assert unit_spread(head) > 0.1, f"{kind}: NLL {nll:.3f} with identical units"
            escaped.append(seed)
    assert len(escaped) >= 2, f"{kind}: below FF's best - 1 on seeds {escaped} of 0-5"


@pytest.mark.parametrize("kind", ["cp", "hmm", "btree"])
def test_random_sum_projections_give_units_different_gradients(kind: str) -> None:
    """The mechanism: at the FF start, zero projections give every unit the same gradient
    (up to rounding); random ones give each unit its own."""

    def unit_gradient_gap(head: MTPCHead) -> float:
        context, windows, _ = toy_problem()
        features = context + FEATURE_NOISE * torch.randn(64, D)
        mode = torch.randint(2, (64,))
        head.circuit.log_prob(head(features), windows[mode]).mean().backward()
        grad = head.unembedding.grad
        assert grad is not None
        return (grad - grad[:, :1]).abs().max().item()

    assert unit_gradient_gap(pretrained_head(kind, sum_init_std=0.0)) < 1e-7
    assert unit_gradient_gap(pretrained_head(kind)) > 1e-5


def test_sum_init_std_rejects_bad_values() -> None:
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="sum_init_std"):
            MTPCHead("cp", N, R, V, D, sum_init_std=bad)  # type: ignore[arg-type]
