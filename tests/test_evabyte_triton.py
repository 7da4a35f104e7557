"""EvaByte's real triton kernels on a CPU (triton's interpreter) against the pure-torch path.

Needs the real remote code, which is never committed: ``MTPC_EVABYTE_CODE=<dir>`` naming a
directory with ``evabyte_hf/*.py`` (OpenEvaByte/evabyte @ 432331a); skipped otherwise. A tiny
random checkpoint of it at GPU-faithful sizes (EVA window 128, chunk 4, head_dim 16: the
blocks an H100 picks, (32, 32)) is built by ``scripts/check_gpu.py`` and every check is
``check_gpu``'s own, run once in a subprocess with ``TRITON_INTERPRET=1`` (set before triton
is imported). The numbers of a run are in docs/BACKBONES.md, "The kernels on a CPU".
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import interpreter_scenarios

REPO = Path(__file__).resolve().parents[1]
CODE = os.environ.get("MTPC_EVABYTE_CODE")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CODE,
        reason="set MTPC_EVABYTE_CODE=<dir with evabyte_hf/*.py> (EvaByte's real remote code, "
        "OpenEvaByte/evabyte @ 432331a; never committed) to run its kernels",
    ),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]

SCENARIOS = r'''
import json, sys, tempfile, time, traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "scripts"))
import check_gpu

args = check_gpu.parse_args(["--device", "cpu", "--evabyte-code", sys.argv[1]])
assert check_gpu.interpreter_mode(args)
root = Path(sys.argv[2])
found = {}


def scenario(name, fn):
    start = time.perf_counter()
    try:
        ok, detail = fn()
        found[name] = {"ok": ok, "detail": detail}
    except Exception as err:  # noqa: BLE001 - reported, asserted by the test
        found[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}",
                       "trace": traceback.format_exc()[-2000:]}
    found[name]["seconds"] = round(time.perf_counter() - start, 1)


path = str(check_gpu.tiny_evabyte_checkpoint(args.evabyte_code, root))
models = {}


def load():
    models["triton"] = model = check_gpu.draft_model("evabyte", path, args)
    info = sys.modules[type(model.backbone.inner).__module__].__mtpc_kernels__
    return model.backbone.use_triton, f"{check_gpu.attention_path(model)}; blocks {info['blocks']}"


scenario("load", load)
scenario("logits", lambda: check_gpu.check_eva_triton(args, path))
scenario("one_pass", lambda: check_gpu.check_one_pass(models["triton"], args))
scenario("greedy", lambda: check_gpu.check_greedy(models["triton"], args))


def train():
    window = check_gpu.EVA_TINY["window_size"]
    steps = check_gpu.compare_objective_steps(args, path, (window - 28, window, window + 32))
    return all(v["loss"] <= 1e-5 and v["grad"] <= 1e-5 for v in steps.values()), steps


scenario("lora_step", train)


def raw_backward():
    """The remote backward itself on a row with no compressed chunk (what compat fixes)."""
    from mtpc.backbones import evabyte_kernels

    backbone = check_gpu.load_target("evabyte", path, args, "triton")  # the package imported again
    kernels = sys.modules[backbone.remote.__name__.rpartition(".")[0] + ".eva_agg_kernel"]
    original = kernels.triton_eva_agg_bwd.__mtpc_original__
    q = torch.randn(1, 4, 100, 16)
    empty = [torch.empty_like(q) for _ in range(4)]
    lse = torch.zeros(1, 4, 100)
    try:
        with evabyte_kernels._kernels_see_gpu((9, 0), cpu_tensors=True):
            original(q, q, q, q, None, None, None, None, q, lse, *empty[:3], None, None,
                     softmax_scale=0.25, window_size=128, chunks_per_window=32,
                     empty_rfa_kv=1, mask_type=0)
    except AttributeError as err:
        return True, f"AttributeError: {err}"
    return False, "the remote backward took rfa_k=None"


scenario("raw_backward", raw_backward)


def reference_logits_in_training_mode():
    """eva_pt_ref.py's cache-free path (a remote forward in training mode) raises; ours never
    takes it: reference_logits runs the remote forward in eval mode."""
    backbone = check_gpu.load_target("evabyte", path, args, "torch")
    ids = torch.randint(64, 320, (1, 128))  # its training forward asserts whole windows
    config = backbone.hf_model.config
    chunk_mask, window_mask = backbone.remote.prepare_eva_attention_mask(
        128, ids.device, config.chunk_size, config.window_size
    )
    backbone.hf_model.train()
    try:  # the 3-tuple of masks eva_pt_ref's cache-free path unpacks
        backbone.hf_model(input_ids=ids, attention_mask=(window_mask, chunk_mask, None),
                          use_cache=False)
        raw = "no error"
    except UnboundLocalError as err:
        raw = f"UnboundLocalError: {err}"
    logits = backbone.reference_logits(ids)
    ours = check_gpu._logits(backbone, ids)
    diff = float((logits[0].float() - ours).abs().max())
    still = backbone.hf_model.training
    return raw.startswith("UnboundLocalError") and diff < 1e-4 and still, (
        f"remote forward in training mode: {raw}; reference_logits {diff:.1e} from ours, "
        f"training mode kept {still}"
    )


scenario("pt_ref_training_forward", reference_logits_in_training_mode)
print("SCENARIOS " + json.dumps(found))
'''


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evabyte_triton")
    found = interpreter_scenarios(SCENARIOS, str(CODE), str(root), timeout=1200)
    print(json.dumps(found, indent=1))  # the numbers (pytest -s), for docs/BACKBONES.md
    return found


def _passed(found: dict[str, Any], name: str) -> dict[str, Any]:
    assert found[name]["ok"] is True, found[name]
    return found[name]


def test_loads_on_the_kernels_with_an_h100s_blocks(scenarios: dict) -> None:
    detail = _passed(scenarios, "load")["detail"]
    assert "CPU interpreter" in detail and "capability 9.0" in detail
    assert "'fwd': (32, 32)" in detail


def test_logits_past_a_window_equal_the_torch_path(scenarios: dict) -> None:
    assert "160 bytes" in _passed(scenarios, "logits")["detail"]


def test_one_pass_verify_across_a_window_boundary(scenarios: dict) -> None:
    _passed(scenarios, "one_pass")


def test_greedy_speculative_equals_autoregressive_across_window_boundaries(
    scenarios: dict,
) -> None:
    assert "230-byte prompt, 48 tokens" in _passed(scenarios, "greedy")["detail"]


def test_lora_step_loss_and_gradients_equal_the_torch_path(scenarios: dict) -> None:
    """Rows of 100 bytes (no compressed chunk: the backward compat fixes), 128 and 160."""
    steps = _passed(scenarios, "lora_step")["detail"]
    assert sorted(steps) == ["100", "128", "160"]
    assert all(v["tensors"] > 0 for v in steps.values())


def test_the_remote_backward_alone_fails_on_a_short_row(scenarios: dict) -> None:
    """Why compat wraps it: the remote code reads ``rfa_k.stride(-1)`` of ``None``."""
    assert (
        "'NoneType' object has no attribute 'stride'"
        in _passed(scenarios, "raw_backward")["detail"]
    )


def test_reference_logits_never_take_eva_pt_refs_cache_free_path(scenarios: dict) -> None:
    _passed(scenarios, "pt_ref_training_forward")
