"""EvaByte's triton path on a CPU through triton's interpreter, without the real remote code.

CI has no EvaByte code (it is never committed), so these tests load a remote package of our
own writing (``tests/fake_checkpoints.py``, ``EVA_AGG_KERNEL``): host wrappers with EvaByte's
interface and failure modes (``is_cuda`` asserts, blocks by
``torch.cuda.get_device_capability()``, a backward that reads ``rfa_k.stride(-1)`` when
``rfa_k is None``, one window per kernel program) around a real ``@triton.jit`` kernel that
the interpreter executes. Each test fails without the piece of ``mtpc.backbones.evabyte_kernels`` it
names: the host shim, the short-row backward fix, the block gate, the interface check.

``TRITON_INTERPRET`` must be set before triton is imported, so the kernels run in one
subprocess per module (``_scenarios``), which reports every scenario as JSON; the pytest
process never sets it. The real kernels: ``tests/test_evabyte_triton.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import interpreter_scenarios

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None,
    reason="triton is not installed (it is in requirements.lock; pip install triton)",
)

SCENARIOS = r'''
import json, os, sys, traceback
from pathlib import Path

import torch

from mtpc.backbones import evabyte_kernels, load_backbone
from mtpc.backbones.remote_code import load_remote_causal_lm
from tests.fake_checkpoints import eva_checkpoint

root = Path(sys.argv[1])
found = {}


def scenario(name):
    def run(fn):
        try:
            found[name] = {"ok": True, **fn()}
        except Exception as err:  # noqa: BLE001 - reported, asserted by the test
            found[name] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                           "trace": traceback.format_exc()[-1500:]}
        return fn
    return run


def kernels(model):
    package = type(model).__module__.rpartition(".")[0]
    return sys.modules[package + ".eva_agg_kernel"]


def reference(v, window):
    """Windowed causal mean of v (B, h, T, d): o[t] = mean of v[s], s in t's window, s <= t."""
    t = torch.arange(v.shape[-2])
    same = ((t[None, :] // window) == (t[:, None] // window)) & (t[None, :] <= t[:, None])
    weight = same.float() / same.float().sum(-1, keepdim=True)
    return weight @ v


def load(window=None, edit=None):
    folder, _ = eva_checkpoint(root, None, window_size=window)
    if edit is not None:
        path = folder / "eva_agg_kernel.py"
        path.write_text(path.read_text().replace(*edit))
    return load_remote_causal_lm("evabyte", str(folder), None, torch.float32, "cpu",
                                        "triton")


def attention(model, window, rows=40, grad=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, rows, 8, requires_grad=grad) for _ in range(3))
    out = kernels(model).eva_agg_func_triton(q, k, v, None, None, None, None, None, window, 2)
    return v, out


def _lookup():
    try:
        torch.cuda.get_device_capability()
        return "returned"
    except Exception as err:  # noqa: BLE001
        return type(err).__name__


@scenario("forward")
def _():
    model = load()
    v, out = attention(model, 16)
    info = sys.modules[type(model).__module__].__mtpc_kernels__
    return {"max_diff": float((out - reference(v, 16)).abs().max()),
            "blocks": info["blocks"]["fwd"], "capability": info["capability"],
            "is_cuda_after": torch.zeros(1).is_cuda,
            "capability_lookup_after": _lookup()}


@scenario("backward")
def _():
    model = load()
    v, out = attention(model, 16, grad=True)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    v_ref = v.detach().clone().requires_grad_(True)
    (reference(v_ref, 16) * weight).sum().backward()
    return {"max_diff": float((v.grad - v_ref.grad).abs().max()),
            "grad_scale": float(v_ref.grad.abs().max())}


@scenario("capability_setting")
def _():
    os.environ[evabyte_kernels.CAPABILITY_ENV] = "8.0"
    try:
        model = load(window=8)  # an A100's BLOCK_M of 8 divides it
        v, out = attention(model, 8)
        info = sys.modules[type(model).__module__].__mtpc_kernels__
    finally:
        del os.environ[evabyte_kernels.CAPABILITY_ENV]
    return {"max_diff": float((out - reference(v, 8)).abs().max()),
            "blocks": info["blocks"]["fwd"], "capability": info["capability"]}


@scenario("gate")
def _():
    load(window=8)  # an H100's BLOCK_M of 16 is larger than the window
    return {}


@scenario("unguarded")
def _():
    """What the gate prevents: an H100's blocks on a window of 8 run, and are wrong."""
    os.environ[evabyte_kernels.CAPABILITY_ENV] = "8.0"
    try:
        model = load(window=8)
    finally:
        del os.environ[evabyte_kernels.CAPABILITY_ENV]
    module = kernels(model)
    torch.manual_seed(0)
    v = torch.randn(2, 3, 40, 8)
    with evabyte_kernels._kernels_see_gpu((9, 0), cpu_tensors=True):
        out, _ = module.triton_eva_agg_fwd.__mtpc_original__(v, v, v, None, None, None, None,
                                                             None, 8, 2)
    return {"max_diff": float((out - reference(v, 8)).abs().max())}


@scenario("interface")
def _():
    load(edit=("chunks_per_window):\n    assert q.is_cuda",
               "chunks_per_window, extra=None):\n    assert q.is_cuda"))
    return {}


@scenario("bfloat16")
def _():
    folder, _ = eva_checkpoint(root, None)
    load_backbone("evabyte", path=str(folder), dtype="bfloat16", attention_impl="triton")
    return {}


print("SCENARIOS " + json.dumps(found))
'''


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario, run once in a subprocess with ``TRITON_INTERPRET=1``."""
    root = tmp_path_factory.mktemp("interpreter")
    return interpreter_scenarios(SCENARIOS, str(root), timeout=600)


def _ok(found: dict[str, Any]) -> dict[str, Any]:
    assert found["ok"], found.get("trace") or found
    return found


@pytest.mark.slow
def test_host_shim_runs_the_kernel_on_cpu_with_an_h100s_blocks(scenarios: dict) -> None:
    """Without the shim the host wrapper's ``is_cuda`` assert (or the capability lookup of a
    CPU-only torch) stops the call; with it the interpreted kernel gives the windowed mean."""
    found = _ok(scenarios["forward"])
    assert found["max_diff"] < 1e-6
    assert found["capability"] == [9, 0] and found["blocks"] == [16, 2]  # the H100 row
    # patched for the call only
    assert found["is_cuda_after"] is False
    if not torch.cuda.is_available():
        assert found["capability_lookup_after"] != "returned"


@pytest.mark.slow
def test_backward_without_compressed_chunks_matches_the_reference(scenarios: dict) -> None:
    """A row no longer than one window has no RFA: the remote backward reads
    ``rfa_k.stride(-1)`` of ``None`` unless compat passes zero-length RFAs."""
    found = _ok(scenarios["backward"])
    assert found["grad_scale"] > 0.01 and found["max_diff"] < 1e-6


@pytest.mark.slow
def test_capability_setting_picks_another_gpus_blocks(scenarios: dict) -> None:
    found = _ok(scenarios["capability_setting"])
    assert found["capability"] == [8, 0] and found["blocks"] == [8, 2]  # the A100 row
    assert found["max_diff"] < 1e-6


@pytest.mark.slow
def test_a_block_larger_than_the_window_is_refused_in_one_line(scenarios: dict) -> None:
    found = scenarios["gate"]
    assert not found["ok"] and found["error"].startswith("KernelBlockError: "), found
    message = found["error"]
    assert "\n" not in message
    assert "window_size=8" in message and "fwd BLOCK_M=16 does not divide window_size=8" in message
    assert "capability 9.0" in message
    assert "allowed: window_size a multiple of 16 and window_size / chunk_size a multiple of 2" in (
        message
    )
    # why: run anyway, those blocks give wrong attention and nothing in the kernel asserts it
    assert _ok(scenarios["unguarded"])["max_diff"] > 0.1


@pytest.mark.slow
def test_a_changed_kernel_interface_is_refused_in_one_line(scenarios: dict) -> None:
    found = scenarios["interface"]
    assert not found["ok"] and found["error"].startswith("KernelInterfaceError: "), found
    assert "triton_eva_agg_fwd has parameters" in found["error"] and "\n" not in found["error"]


@pytest.mark.slow
def test_bfloat16_is_refused_under_the_interpreter(scenarios: dict) -> None:
    found = scenarios["bfloat16"]
    assert not found["ok"] and found["error"].startswith("AttentionImplError: "), found
    assert "model.dtype is 'bfloat16'" in found["error"] and "#11584" in found["error"]
    assert "allowed there: model.dtype=float32" in found["error"]


# -- in this process (TRITON_INTERPRET never set before: triton is imported compiled) --------------
def test_the_interpreter_is_refused_when_triton_was_imported_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mtpc.backbones.evabyte_kernels import AttentionImplError, resolve_attention_impl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton.language.standard  # noqa: F401  (imported compiled, as any plain run)

    with pytest.raises(AttentionImplError, match=r"CUDA device .*TRITON_INTERPRET=1"):
        resolve_attention_impl("triton", "cpu", torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AttentionImplError, match="imported before TRITON_INTERPRET=1 was set"):
        resolve_attention_impl("triton", "cpu", torch.float32)
    with pytest.raises(AttentionImplError, match=r"model\.dtype is 'bfloat16'"):
        resolve_attention_impl("triton", "cpu", torch.bfloat16)
    assert resolve_attention_impl("auto", "cpu", torch.float32) == "torch"  # never the interpreter


# -- the command line: our one line, not Hydra's wrapped ValueError -----------------------------
def _cli(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c"),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    for name in ("TRITON_INTERPRET", "HYDRA_FULL_ERROR"):
        env.pop(name, None)
    command = [sys.executable, str(REPO / script), *args, f"hydra.run.dir={tmp_path / 'out'}"]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)


@pytest.mark.slow
def test_triton_on_a_cpu_without_the_interpreter_is_one_line_at_the_command_line(
    tmp_path: Path,
) -> None:
    from mtpc.backbones import load_backbone
    from mtpc.model import MTPCModel
    from tests.fake_checkpoints import eva_checkpoint

    folder, _ = eva_checkpoint(tmp_path, None)
    draft = tmp_path / "draft"
    backbone = load_backbone("evabyte", path=str(folder), attention_impl="torch")
    MTPCModel.from_backbone(backbone, "cp", 4, 2).save_pretrained(draft)
    model = ["model=evabyte", f"model.path={folder}", "model.attention_impl=triton"]
    runs = {
        "train.py": _cli("train.py", [*model, "model.dtype=float32", "data.num_rows=40"], tmp_path),
        "eval.py": _cli("eval.py", [*model, f"draft={draft}", "num_prompts=1"], tmp_path),
    }
    for script, run in runs.items():
        last = [line for line in run.stderr.splitlines() if line.strip()][-1]
        assert run.returncode == 2, (script, run.stderr[-3000:])
        assert "Traceback" not in run.stderr and "HYDRA_FULL_ERROR" not in run.stderr, script
        assert last.startswith("error: model.attention_impl is 'triton' but device is 'cpu'"), (
            script, last,
        )  # fmt: skip
        assert "TRITON_INTERPRET=1" in last
