"""Exactness of ``mtpc.paper_import`` against the MTPC paper's own code (no network).

Takes a local copy of the paper's Python files (a directory holding their ``mtp/`` package:
``mtp/models/{circuits,circuit_layers,circuit_queries,circuit_region_graphs,pipeline}.py``
and ``mtp/models/evabyte/mtp_head.py``) and of cirkit at commit af07851 (a directory holding
``cirkit/``), and for each case (family, n, r):

1. builds their circuit (``CircuitModel``, compiled by cirkit) and their head
   (``MultiTokenHead``, the linear expander, bf16 as they build it), with projections drawn
   from N(0, 0.3^2) (their init, U(+-0.01275), gives near-uniform sums: a weak test);
2. saves a checkpoint in their format (``config.yaml`` + ``model@<step>.pt`` with
   ``mt_head.*``, ``circuit.*`` and a frozen-LM key of value None);
3. imports it (``read_paper_draft`` + ``head_state``) into our ``MTPCHead``;
4. compares, for random features and windows, the window log-probability and every prefix
   marginal (their ``IntegrateQuery`` with ``_autoregressive_mar_mask``):
   - float64: their head's own ``LinearHead`` modules in float64, followed by the three lines
     of their ``MultiTokenHead.forward`` (permute, softmax / log_softmax) without its
     ``.float()`` cast, against our head in float64: must agree to 1e-9;
   - bf16: their head's own forward (bf16 einsum, then float32) against our imported bf16
     head: must agree within bf16 rounding (0.05 nats);
   - a control: the same import with every square sum weight transposed must differ.

LoRA is not exercised here (it is peft's own layout; ``tests/test_paper_import.py`` checks it
against their merged-weights convention).

    python scripts/check_paper_import.py <dir with their mtp/> <dir with cirkit af07851's cirkit/>

Exit status 0 when every check passes; the report is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

CASES = [
    ("ff", 8, 1),
    ("cp", 8, 3),
    ("hmm", 8, 3),
    ("btree", 8, 3),
    ("cp", 16, 2),
    ("hmm", 16, 2),
    ("btree", 16, 2),
    ("btree", 32, 2),
]
V, D, B = 13, 8, 6


def _import_theirs(code: Path, cirkit: Path) -> tuple[Any, Any]:
    for path in (cirkit, code):
        sys.path.insert(0, str(path))
    import cirkit as cirkit_mod  # theirs, pinned

    where = Path(cirkit_mod.__file__).resolve()
    if cirkit.resolve() not in where.parents:
        raise SystemExit(
            f"cirkit resolves to {where}, not under {cirkit}; give cirkit's parent dir"
        )
    from mtp.models.circuits import CircuitModel
    from mtp.models.evabyte.mtp_head import MultiTokenHead

    return CircuitModel, MultiTokenHead


def _their_config(kind: str, n: int, r: int) -> dict[str, Any]:
    theirs = "cp" if kind == "ff" else kind
    return {
        "circuit": {
            "name": theirs, "n_token": n, "n_component": r, "n_repetition": 1,
            "model": {"_target_": "mtp.models.circuits.CircuitModel", "vocab_size": V,
                      "n_token": n, "n_component": r, "n_repetition": 1, "kind": theirs},
        },
        "mt_head": {"name": "linear-evabyte", "hyperparameters": {
            "type": "evabyte", "n_embd": D, "transformer_n_head": 1, "transformer_n_layer": 0,
            "expander_type": "linear", "expander_n_layer": 1, "freeze_vocab_unembedding": False,
            "share_sum_weights": False, "contextual_hmm_weights": True, "init_hmm_identity": False,
        }},
        "adaptor": {"name": "none", "hyperparameters": {}},
        "lm": {"name": "check", "n_embd": D, "model": {"from_huggingface": "check/none"}},
    }  # fmt: skip


def _their_params(head: Any, e: torch.Tensor, cast: bool) -> dict[str, list[torch.Tensor]]:
    """Their MultiTokenHead.forward on (B, 1, d); ``cast=False`` skips its ``.float()``."""
    if cast:
        return head(e[:, None, :])  # type: ignore[no-any-return]
    xx = e[:, None, :]
    sums = [torch.softmax(h(xx).permute(2, 0, 1, 3, 4), -1) for h in head._sum_weights_heads]
    cats = [
        torch.log_softmax(h(xx).permute(2, 0, 1, 3, 4), -1)
        for h in head._categorical_log_probs_heads
    ]
    return {"sum": sums, "categorical": cats}


def _their_prefix(circuit: Any, params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    circuit.parameterize({"categorical": params["categorical"], "sum": params["sum"]})
    n = x.shape[1]
    cols = [
        circuit(x, marg_mask=circuit._autoregressive_mar_mask[m].expand(x.shape[0], -1))
        if m < n - 1
        else circuit(x)
        for m in range(n)
    ]
    return torch.stack(cols, 1)  # (B, n)


def check_case(
    kind: str, n: int, r: int, CircuitModel: Any, MultiTokenHead: Any, tmp: Path
) -> dict[str, Any]:
    from mtpc.heads import MTPCHead
    from mtpc.paper_import import head_state, read_paper_draft

    torch.manual_seed(n * 31 + r)
    circuit = CircuitModel(V, n, r, kind="cp" if kind == "ff" else kind)
    head = MultiTokenHead(
        circuit.parameters_config, V, n_embd=D, transformer_n_head=1, transformer_n_layer=0,
        expander_type="linear", expander_n_layer=1, expander_use_skip=False,
    )  # fmt: skip
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    folder = tmp / f"{kind}-n{n}-r{r}"
    folder.mkdir()
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create(_their_config(kind, n, r)), folder / "config.yaml")
    state: dict[str, Any] = {f"mt_head.{k}": v for k, v in head.state_dict().items()}
    state.update({f"circuit.{k}": v for k, v in circuit.state_dict().items()})
    state["lm._lm.base_model.model.model.norm.weight"] = None
    torch.save(
        {"global_step": 7, "model_state_dict": state, "optimizer_state_dict": None,
         "scheduler_state_dict": None},
        folder / "model@7.pt",
    )  # fmt: skip

    draft = read_paper_draft(folder)
    mapped = head_state(draft, MTPCHead(kind, n, r, V, D).structure)
    e = torch.randn(B, D, dtype=torch.float64)
    x = torch.randint(0, V, (B, n))
    out: dict[str, Any] = {"case": f"{kind} n={n} r={r}", "dtype": str(draft.dtype)}

    ours64 = MTPCHead(kind, n, r, V, D).double()
    ours64.load_state_dict({k: v.double() for k, v in mapped.items()})
    with torch.no_grad():
        theirs = _their_prefix(circuit, _their_params(head.double(), e, cast=False), x)
        mine = ours64.circuit.prefix_log_prob(ours64(e), x)
    out["float64_max_abs_diff"] = float((theirs - mine).abs().max())

    ours16 = MTPCHead(kind, n, r, V, D).to(torch.bfloat16)
    ours16.load_state_dict(mapped)
    head = head.to(torch.bfloat16)
    e16 = e.to(torch.bfloat16)
    with torch.no_grad():
        theirs16 = _their_prefix(circuit, _their_params(head, e16, cast=True), x)
        mine16 = ours16.circuit.prefix_log_prob(ours16(e16), x)
    out["bf16_max_abs_diff"] = float((theirs16.double() - mine16.double()).abs().max())

    if draft.sums and any(w.shape[1] == w.shape[2] for w in draft.sums):
        draft.sums = [w.transpose(1, 2) if w.shape[1] == w.shape[2] else w for w in draft.sums]
        ours64.load_state_dict(
            {k: v.double() for k, v in head_state(draft, ours64.structure).items()}
        )
        with torch.no_grad():
            wrong = ours64.circuit.prefix_log_prob(ours64(e), x)
        out["transposed_control_max_abs_diff"] = float((theirs - wrong).abs().max())
    out["window_log_prob_range"] = [float(theirs[:, -1].min()), float(theirs[:, -1].max())]
    out["ok"] = (
        out["float64_max_abs_diff"] <= 1e-9
        and out["bf16_max_abs_diff"] <= 0.05
        and out.get("transposed_control_max_abs_diff", 1.0) > 1e-3
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("code", type=Path, help="directory holding their mtp/ package")
    parser.add_argument("cirkit", type=Path, help="directory holding cirkit af07851's cirkit/")
    args = parser.parse_args()
    CircuitModel, MultiTokenHead = _import_theirs(args.code, args.cirkit)
    with tempfile.TemporaryDirectory() as tmp:
        report = [check_case(*c, CircuitModel, MultiTokenHead, Path(tmp)) for c in CASES]
    print(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
