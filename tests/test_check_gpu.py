"""scripts/check_gpu.py in its CPU mode: every check prints its line, a broken one FAILs.

The script runs the GPU self-check's checks on the bundled tiny target (and the tiny
EvaByte of the real remote code when ``MTPC_EVABYTE_CODE`` names it); on CPU the triton
check and the two-process training (no second GPU) are SKIPs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import mtpc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_gpu.py"


def _lines(output: str) -> dict[str, str]:
    """``{check name: status}`` of the script's report lines."""
    out = {}
    for line in output.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL", "SKIP"):
            out[rest.split(":")[0]] = status
    return out


@pytest.mark.slow
def test_cpu_mode_passes_every_check_it_can_run(tmp_path: Path) -> None:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu"], env=env,
                            cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    lines = _lines(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    for name in ("device", "one_pass_verify[tiny]", "greedy_spec_equals_ar[tiny]",
                 "ar_vs_hf_generate[tiny]", "train[single]"):  # fmt: skip
        assert lines.get(name) == "PASS", (name, result.stdout)
    assert lines["eva_triton_vs_torch"] == "SKIP" and lines["train[ddp]"] == "SKIP"
    train = next(line for line in result.stdout.splitlines() if "train[single]" in line)
    for word in ("attention", "['float32']", "every trainable tensor moved", "peak", "step ms",
                 "trained weights only"):  # fmt: skip
        assert word in train, train


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_broken_conditions_fail_and_exit_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 LoRA (no upcast), a speculative decoder that loses a token and a too slow AR."""
    import mtpc.training.module as module

    generate = mtpc.generate

    def lossy(*args: Any, **kwargs: Any) -> Any:
        result = generate(*args, **kwargs)
        if kwargs.get("method") == "speculative":
            result.tokens[-1] = (result.tokens[-1] + 1) % 256
        return result

    monkeypatch.setattr(mtpc, "generate", lossy)
    monkeypatch.setattr(module, "upcast_trainable", lambda model: [])
    monkeypatch.setenv("MTPC_CACHE", str(tmp_path / "c"))
    monkeypatch.chdir(tmp_path)
    code = _script().main(["--device", "cpu", "--dtype", "bfloat16", "--min-ar-speed", "1000"])
    output = capsys.readouterr().out
    lines = _lines(output)
    assert code == 1, output
    assert lines["greedy_spec_equals_ar[tiny]"] == "FAIL", output
    assert lines["ar_vs_hf_generate[tiny]"] == "FAIL", output
    assert lines["train[single]"] == "FAIL", output  # bf16 LoRA weights
    assert lines["one_pass_verify[tiny]"] == "PASS", output
