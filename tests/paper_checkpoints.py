"""Checkpoints in the MTPC paper's layout (april-tools/mtpc), written by our own code.

``write_paper_draft`` writes a folder as the paper's training leaves it: ``config.yaml`` and
``model@<step>.pt`` with ``{global_step, model_state_dict, optimizer_state_dict,
scheduler_state_dict}``. The state dict follows their key layout: the linear expander's
``mt_head._categorical_log_probs_heads.0.head.proj`` (n, r, V, d) and
``mt_head._sum_weights_heads.{k}.head.proj`` (F, K_out, K_in, d) in the circuit's
topological order, the folded circuit's buffers (the input layer's ``_scope_idx``, the
address book's ``_in_fold_idx_{i}_0``), LoRA under peft's names behind
``lm._lm.base_model.model.`` and every frozen-LM key with value None.

``reference_prefix_log_probs`` evaluates such a checkpoint from its raw tensors in their
convention (inputs ``log_softmax(proj . e)``, sums ``softmax(proj . e)`` over K_in, the HMM
chain S_{n-1}(phi_{n-1}), S_i(S_{i+1} ⊙ phi_i)), in float64: the independent side of the
import tests. No code of the paper's repository is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

LORA_MODULES = ("gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj")


@dataclass
class PaperLayout:
    """A paper circuit's folded layout.

    Attributes:
        scope_idx: (n,) window position of each input fold.
        layers: inner layers in topological order: (``"product"`` | ``"sum"``, idx (F, H)
            into the layer before, fold scopes).
        out_units: per sum layer, K_out.
    """

    scope_idx: Tensor
    layers: list[tuple[str, Tensor, list[tuple[int, ...]]]]
    out_units: list[int]


def _btree_regions(n: int) -> list[list[tuple[int, ...]]]:
    """Regions of their BTree by height (0: leaves), split at round(len/2) (half to even)."""
    by_height: dict[int, list[tuple[int, ...]]] = {}

    def walk(scope: tuple[int, ...]) -> int:
        if len(scope) == 1:
            h = 0
        else:
            cut = round(len(scope) / 2)
            h = 1 + max(walk(scope[:cut]), walk(scope[cut:]))
        by_height.setdefault(h, []).append(scope)
        return h

    walk(tuple(range(n)))
    return [sorted(by_height[h]) for h in sorted(by_height)]


def paper_layout(kind: str, n: int, r: int, reverse_folds: bool = False) -> PaperLayout:
    """Their folded circuit for ``kind`` (``ff``: their ``cp`` with r = 1).

    Args:
        kind: ``ff``, ``cp``, ``hmm`` or ``btree`` (n a power of two).
        n: window.
        r: units.
        reverse_folds: BTree only: store every layer's folds right to left (a folding the
            importer must read from the address book, not assume).
    """
    if kind in ("ff", "cp"):
        layers = [("product", torch.arange(n)[None], [tuple(range(n))])]
        if kind == "cp":
            layers.append(("sum", torch.zeros(1, 1, dtype=torch.long), [tuple(range(n))]))
        return PaperLayout(torch.arange(n), layers, [1] if kind == "cp" else [])
    if kind == "hmm":
        # inputs in the order cirkit's hmm creates them: position n-1 first
        scope_idx = torch.arange(n - 1, -1, -1)
        fold_of = {int(p): f for f, p in enumerate(scope_idx)}
        layers = [("sum", torch.tensor([[fold_of[n - 1]]]), [(n - 1,)])]
        for i in range(n - 2, -1, -1):
            # the product reads cat(previous sum (1 fold), inputs (n folds))
            layers.append(("product", torch.tensor([[0, 1 + fold_of[i]]]), [tuple(range(i, n))]))
            layers.append(("sum", torch.zeros(1, 1, dtype=torch.long), [tuple(range(i, n))]))
        return PaperLayout(scope_idx, layers, [r] * (n - 1) + [1])
    assert kind == "btree" and n & (n - 1) == 0
    regions = _btree_regions(n)
    order = (lambda xs: xs[::-1]) if reverse_folds else (lambda xs: xs)
    prev = order(regions[0])  # input folds: one position each
    scope_idx = torch.tensor([s[0] for s in prev])
    layers, out_units = [], []
    for h in range(1, len(regions)):
        level = order(regions[h])
        where = {s: f for f, s in enumerate(prev)}
        idx = []
        for s in level:
            cut = round(len(s) / 2)
            idx.append([where[s[:cut]], where[s[cut:]]])
        layers.append(("product", torch.tensor(idx), level))
        layers.append(("sum", torch.arange(len(level))[:, None], level))
        out_units.append(1 if h == len(regions) - 1 else r)
        prev = level
    return PaperLayout(scope_idx, layers, out_units)


def _fold_size(layout: PaperLayout, i: int) -> int:
    """Folds entry i's index ranges over: the layer before (HMM products: a sum and the inputs)."""
    idx = layout.layers[i - 1][1]
    return max(int(idx.max()) + 1, len(layout.layers[i - 2][2]) if i > 1 else len(layout.scope_idx))


def _is_unsqueeze(idx: Tensor, fold_size: int) -> bool:
    """cirkit's rule: a gather of every fold in order into one fold, or fold f from fold f."""
    if idx.flatten().tolist() != list(range(fold_size)):
        return False
    return idx.shape[0] == 1 or idx.shape[1] == 1


def paper_head(
    layout: PaperLayout, n: int, r: int, V: int, d: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, Tensor]:
    """Random head projections in their layout (std 0.3: sums far from uniform)."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "mt_head._categorical_log_probs_heads.0.head.proj": (
            torch.randn(n, r, V, d, generator=g, dtype=torch.float64) * 0.3
        ).to(dtype)
    }
    k = 0
    for kind, idx, _ in layout.layers:
        if kind == "sum":
            K_out = layout.out_units[k]
            w = torch.randn(idx.shape[0], K_out, r, d, generator=g, dtype=torch.float64) * 0.3
            out[f"mt_head._sum_weights_heads.{k}.head.proj"] = w.to(dtype)
            k += 1
    return out


def paper_config(
    kind: str, n: int, r: int, d: int, V: int, lm_id: str, lora_layers: list[int]
) -> dict[str, Any]:
    """Their resolved Hydra config (the fields the importer reads, and a few more)."""
    theirs = "cp" if kind == "ff" else kind
    adaptor: dict[str, Any] = {"name": "none", "hyperparameters": {}}
    if lora_layers:
        adaptor = {
            "name": f"lora-last-{len(lora_layers)}",
            "hyperparameters": {
                "r": 16, "lora_alpha": 16, "lora_dropout": 0.0,
                "target_modules": list(LORA_MODULES), "layers_to_transform": lora_layers,
            },
        }  # fmt: skip
    return {
        "circuit": {
            "name": theirs, "n_token": n, "n_component": r, "n_repetition": 1,
            "model": {
                "_target_": "mtp.models.circuits.CircuitModel", "vocab_size": V,
                "n_token": n, "n_component": r, "n_repetition": 1, "kind": theirs,
            },
        },
        "mt_head": {
            "name": "linear-evabyte",
            "hyperparameters": {
                "type": "evabyte", "n_embd": d, "transformer_n_head": 4,
                "transformer_n_layer": 0, "expander_type": "linear", "expander_n_layer": 1,
                "freeze_vocab_unembedding": False, "share_sum_weights": False,
                "contextual_hmm_weights": True,
                "init_hmm_identity": False,  # true: an HMM bias of unknown form (refused)
            },
        },
        "adaptor": adaptor,
        "lm": {"name": "test-lm", "n_embd": d, "model": {"from_huggingface": lm_id}},
        "model": {"model": {"beta": 0.0, "gamma": 0.9}},
        "data": {"vocab_size": V},
        "training": {"expname": f"test-{kind}-n-{n}-r-{r}"},
    }  # fmt: skip


def paper_state(
    kind: str,
    n: int,
    r: int,
    V: int,
    d: int,
    *,
    dtype: torch.dtype = torch.float64,
    reverse_folds: bool = False,
    hf_model: Any = None,
    lora_layers: list[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A ``model_state_dict`` in their key layout.

    ``hf_model``: the frozen LM whose keys appear with value None (and whose last layers get
    LoRA, random A and B, when ``lora_layers``).
    """
    layout = paper_layout(kind, n, r, reverse_folds)
    state: dict[str, Any] = paper_head(layout, n, r, V, d, dtype, seed)
    state["circuit._circuit._nodes.0._scope_idx"] = layout.scope_idx[:, None].clone()
    for i, (_, idx, _) in enumerate(layout.layers, start=1):
        if not _is_unsqueeze(idx, _fold_size(layout, i)):  # cirkit stores no unsqueeze
            state[f"circuit._circuit._address_book._in_fold_idx_{i}_0"] = idx.clone()
    state[f"circuit._circuit._address_book._in_fold_idx_{len(layout.layers) + 1}_0"] = torch.zeros(
        1, dtype=torch.long
    )
    state["circuit._autoregressive_mar_mask"] = torch.ones(n, n, dtype=torch.bool).triu(1)
    state["circuit._univariate_mar_mask"] = ~torch.eye(n, dtype=torch.bool)
    if hf_model is not None:
        g = torch.Generator().manual_seed(seed + 1)
        for name, _ in hf_model.state_dict().items():
            state[f"lm._lm.base_model.model.{name}"] = None
        for L in lora_layers or []:
            layer = hf_model.model.layers[L]
            for mod_name, mod in layer.named_modules():
                short = mod_name.rsplit(".", 1)[-1]
                if short not in LORA_MODULES or not isinstance(mod, torch.nn.Linear):
                    continue
                prefix = f"lm._lm.base_model.model.model.layers.{L}.{mod_name}"
                a = torch.randn(16, mod.in_features, generator=g) * 0.05
                b = torch.randn(mod.out_features, 16, generator=g) * 0.05
                state[f"{prefix}.lora_A.default.weight"] = a.to(dtype)
                state[f"{prefix}.lora_B.default.weight"] = b.to(dtype)
    return state


def write_paper_draft(
    folder: Path,
    kind: str,
    n: int,
    r: int,
    V: int,
    d: int,
    *,
    step: int = 1200,
    lm_id: str = "test/tiny",
    config_over: dict[str, Any] | None = None,
    state_over: dict[str, Any] | None = None,
    **state_kwargs: Any,
) -> Path:
    """Writes a paper draft folder; ``*_over`` replace config fields / state keys (None: drop)."""
    folder.mkdir(parents=True, exist_ok=True)
    lora_layers = state_kwargs.get("lora_layers") or []
    config = OmegaConf.create(paper_config(kind, n, r, d, V, lm_id, lora_layers))
    for key, value in (config_over or {}).items():
        OmegaConf.update(config, key, value, force_add=True)
    OmegaConf.save(config, folder / "config.yaml")
    state = paper_state(kind, n, r, V, d, **state_kwargs)
    for key, value in (state_over or {}).items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    ckpt = {
        "global_step": step,
        "model_state_dict": state,
        "optimizer_state_dict": None,
        "scheduler_state_dict": None,
    }
    torch.save(ckpt, folder / f"model@{step}.pt")
    return folder


# ----------------------------------------------------------------------------- reference ----
def _leaves(state: dict[str, Any], e: Tensor, x: Tensor, m: int) -> Tensor:
    """(F, B, R) input-fold log-values with positions >= m marginalised (log 1 = 0)."""
    proj = state["mt_head._categorical_log_probs_heads.0.head.proj"].double()  # (F, R, V, d)
    scope = state["circuit._circuit._nodes.0._scope_idx"][:, 0]
    logp = torch.log_softmax(torch.einsum("frvd,bd->fbrv", proj, e), -1)  # (F, B, R, V)
    tok = x[:, scope].T  # (F, B)
    picked = logp.gather(3, tok[:, :, None, None].expand(-1, -1, logp.shape[2], 1))[..., 0]
    return torch.where((scope < m)[:, None, None], picked, torch.zeros_like(picked))


def _sum(state: dict[str, Any], k: int, e: Tensor, child: Tensor) -> Tensor:
    """Their sum layer k: out[f, b, o] = log sum_i softmax_i(proj[f, o, i] . e) exp(child[f, b, i])."""
    proj = state[f"mt_head._sum_weights_heads.{k}.head.proj"].double()  # (F, O, I, d)
    logw = torch.log_softmax(torch.einsum("foid,bd->fboi", proj, e), -1)
    return torch.logsumexp(logw + child[:, :, None, :], -1)  # (F, B, O)


def _inner_layers(state: dict[str, Any], n: int, kind: str) -> list[tuple[str, Tensor | None]]:
    """(kind, stored fold index or None) of each inner layer of an ff / cp / btree circuit."""
    kinds = {"ff": ["product"], "cp": ["product", "sum"]}.get(
        kind, ["product", "sum"] * (n.bit_length() - 1)
    )
    prefix = "circuit._circuit._address_book._in_fold_idx_"
    return [(k, state.get(f"{prefix}{i}_0")) for i, k in enumerate(kinds, start=1)]


def reference_prefix_log_probs(
    state: dict[str, Any], kind: str, n: int, e: Tensor, x: Tensor
) -> Tensor:
    """(B, n) log q(x_1..x_m) of a paper checkpoint, from its raw tensors (float64).

    ``e``: (B, d) features; ``x``: (B, n) tokens.
    """
    e = e.double()
    cols = []
    for m in range(1, n + 1):
        leaves = _leaves(state, e, x, m)  # (F, B, R)
        if kind == "hmm":
            scope = state["circuit._circuit._nodes.0._scope_idx"][:, 0].tolist()
            phi = {p: leaves[f] for f, p in enumerate(scope)}  # (B, R)
            node = _sum(state, 0, e, phi[n - 1][None])[0]
            for k, i in enumerate(range(n - 2, -1, -1), start=1):
                node = _sum(state, k, e, (node + phi[i])[None])[0]
            cols.append(node[:, 0])
            continue
        prev, k = leaves, 0
        for kind_i, idx in _inner_layers(state, n, kind):
            if idx is None:  # an unsqueeze cirkit does not store
                F = prev.shape[0]
                idx = torch.arange(F)[None] if kind_i == "product" else torch.arange(F)[:, None]
            gathered = prev[idx]  # (F, H, B, K)
            if kind_i == "sum":
                prev = _sum(state, k, e, gathered[:, 0])
                k += 1
            else:  # a Hadamard product
                prev = gathered.sum(1)
        cols.append(prev[0, :, 0])
    return torch.stack(cols, 1)
