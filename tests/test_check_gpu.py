"""scripts/check_gpu.py in its CPU mode: every check prints its line, a broken one FAILs.

The script runs the GPU self-check's checks on the bundled tiny target and, when
``MTPC_EVABYTE_CODE`` names EvaByte's real remote code, on a tiny EvaByte of it through
triton's CPU interpreter (its kernels, float32); without it the EvaByte lines and the
two-process training (no second GPU) are SKIPs. No check can abort the script: a crash is
a FAIL line.
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
    """Every check PASSes on a CPU (the AR speed floor off: no timed assertion in a test)."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    env.pop("MTPC_EVABYTE_CODE", None)
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--min-ar-speed", "0"]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    lines = _lines(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    for name in ("device", "load[tiny]", "one_pass_verify[tiny]", "greedy_spec_equals_ar[tiny]",
                 "ar_vs_hf_generate[tiny]", "train[single]"):  # fmt: skip
        assert lines.get(name) == "PASS", (name, result.stdout)
    for name in ("load[evabyte-tiny]", "eva_triton_vs_torch", "eva_train_triton_vs_torch",
                 "train[ddp]"):  # fmt: skip
        assert lines[name] == "SKIP", (name, result.stdout)
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

    monkeypatch.delenv("MTPC_EVABYTE_CODE", raising=False)
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


@pytest.mark.slow
def test_a_check_that_crashes_is_a_fail_line_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building a target ran outside the reporter: one crash stopped the script."""
    script = _script()

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("the target cannot be built")

    monkeypatch.delenv("MTPC_EVABYTE_CODE", raising=False)
    monkeypatch.setattr(script, "draft_model", broken)
    monkeypatch.setenv("MTPC_CACHE", str(tmp_path / "c"))
    monkeypatch.chdir(tmp_path)
    code = script.main(["--device", "cpu"])
    output = capsys.readouterr().out
    lines = _lines(output)
    assert code == 1, output
    assert lines["load[tiny]"] == "FAIL" and "the target cannot be built" in output
    assert lines["train[single]"] == "PASS", output  # later checks still ran
    assert "one_pass_verify[tiny]" not in lines  # nothing to verify without the target


EVABYTE_CODE = os.environ.get("MTPC_EVABYTE_CODE")


@pytest.mark.slow
@pytest.mark.skipif(
    not EVABYTE_CODE or importlib.util.find_spec("triton") is None,
    reason="set MTPC_EVABYTE_CODE=<dir with evabyte_hf/*.py> (EvaByte's real remote code, "
    "never committed) and install triton to run its kernels through the interpreter",
)
def test_cpu_mode_runs_evabytes_kernels_through_the_interpreter_and_a_broken_one_fails(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--evabyte-code", str(EVABYTE_CODE)]
    good = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    lines = _lines(good.stdout)
    assert good.returncode == 0, good.stdout + good.stderr[-2000:]
    for name in ("load[evabyte-tiny]", "eva_triton_vs_torch", "eva_train_triton_vs_torch",
                 "one_pass_verify[evabyte-tiny]", "greedy_spec_equals_ar[evabyte-tiny]"):  # fmt: skip
        assert lines.get(name) == "PASS", (name, good.stdout)
    load = next(line for line in good.stdout.splitlines() if "load[evabyte-tiny]" in line)
    assert "triton (CPU interpreter" in load  # the attention path actually used

    broken = subprocess.run([*command, "--break-kernel"], env=env, cwd=tmp_path,
                            capture_output=True, text=True)  # fmt: skip
    lines = _lines(broken.stdout)
    assert broken.returncode == 1, broken.stdout
    assert "Traceback" not in broken.stdout + broken.stderr
    assert lines["eva_triton_vs_torch"] == "FAIL" and lines["eva_train_triton_vs_torch"] == "FAIL"
    assert "fwd BLOCK_M=256 does not divide window_size=128" in broken.stdout
