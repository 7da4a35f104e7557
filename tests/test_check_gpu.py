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
    """Every check PASSes on a CPU (the AR speed floor off: no timed assertion in a test),
    the compiled engine's lines with ``--compile aot_eager`` (B = 1 and B = 8, rows replaced,
    five new prompt lengths without a recompilation)."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "MTPC_CACHE": str(tmp_path / "c")}
    env.pop("MTPC_EVABYTE_CODE", None)
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--min-ar-speed", "0",
               "--compile", "aot_eager"]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    lines = _lines(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    compiled = [f"{name}[tiny]" for name in _script().COMPILED_LINES]
    for name in ("device", "load[tiny]", "one_pass_verify[tiny]", "greedy_spec_equals_ar[tiny]",
                 "ar_vs_hf_generate[tiny]", "train[single]", *compiled):  # fmt: skip
        assert lines.get(name) == "PASS", (name, result.stdout)
    assert "stop id" in result.stdout and "0 new graphs" in result.stdout
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


# -- the bf16 tie rule of greedy_spec_equals_ar ---------------------------------------------------
def test_flip_explained_is_the_two_sided_noise_bound() -> None:
    """A flip is rounding iff the one-token gap is at most twice the logit noise."""
    import torch

    flip_explained = _script().flip_explained
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])  # the one-token path picks 1; 2 is 0.1 below
    assert flip_explained(logits, 1, 2, noise=0.05) == pytest.approx(0.1)  # 0.1 <= 2 x 0.05
    assert flip_explained(logits, 1, 2, noise=0.04) is None  # 0.1 > 2 x 0.04
    assert flip_explained(logits, 1, 3, noise=0.05) is None  # 8.0: a wrong token


class _Planted:
    """``mtpc.generate`` whose first speculative result has token ``at`` replaced by the
    target's ``rank``-th choice there (1: the runner-up; -1: the least likely token)."""

    def __init__(self, model: Any, at: int, rank: int) -> None:
        self.model, self.at, self.rank, self.done = model, at, rank, False
        self.generate = mtpc.generate
        self.gap = 0.0

    def __call__(self, model: Any, context: list[int], **kwargs: Any) -> Any:
        import torch

        result = self.generate(model, context, **kwargs)
        if kwargs.get("method") != "speculative" or self.done:
            return result
        self.done = True
        backbone = self.model.backbone
        ids = torch.tensor([context + list(result.tokens[: self.at])])
        with torch.no_grad():
            hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)
            logits = backbone.stp_logits(backbone.norm(hidden))[0, -1].float()  # (V,)
        order = logits.argsort(descending=True)
        assert int(order[0]) == result.tokens[self.at]  # still the target's own so far
        planted = int(order[self.rank])
        self.gap = float(logits[order[0]] - logits[planted])
        result.tokens[self.at] = planted
        return result


def _greedy_with_planted(
    monkeypatch: pytest.MonkeyPatch, rank: int, noise_of_gap: float | None
) -> tuple[bool | None, str, _Planted]:
    """check_greedy in bf16 with a planted flip at token 5; ``noise_of_gap``: the measured
    one-pass noise replaced by this share of the planted flip's gap (None: measured)."""
    script = _script()
    args = script.parse_args(["--device", "cpu", "--dtype", "bfloat16", "--new-tokens", "12"])
    model = script.draft_model("tiny", None, args)
    planted = _Planted(model, at=5, rank=rank)
    monkeypatch.setattr(mtpc, "generate", planted)
    if noise_of_gap is not None:
        measure = script.one_pass_logits

        def noisy(*a: Any) -> Any:
            _, seq = measure(*a)
            return seq + noise_of_gap * planted.gap, seq

        monkeypatch.setattr(script, "one_pass_logits", noisy)
    ok, detail = script.check_greedy(model, args)
    return ok, detail, planted


def test_a_flip_inside_the_noise_is_a_counted_bf16_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, detail, planted = _greedy_with_planted(monkeypatch, rank=1, noise_of_gap=0.6)
    assert planted.done and planted.gap > 0
    assert ok is True, detail
    assert "equal up to 1 bfloat16 tie(s)" in detail and "token 5" in detail, detail


def test_a_flip_outside_the_noise_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, detail, planted = _greedy_with_planted(monkeypatch, rank=1, noise_of_gap=0.4)
    assert planted.done and planted.gap > 0
    assert ok is False, detail
    assert "token 5" in detail and "not a bfloat16 tie" in detail, detail


def test_a_planted_wrong_token_fails_against_the_measured_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The least likely byte in place of the target's: a rule that accepts every flip (or a
    noise measurement that is never compared) passes this run."""
    ok, detail, planted = _greedy_with_planted(monkeypatch, rank=-1, noise_of_gap=None)
    assert planted.done and planted.gap > 1.0
    assert ok is False, detail
    assert "a wrong token" in detail, detail


def test_float32_allows_no_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    """In float32 one pass and one token agree to 1e-5: a runner-up flip FAILs there."""
    script = _script()
    args = script.parse_args(["--device", "cpu", "--dtype", "float32", "--new-tokens", "12"])
    model = script.draft_model("tiny", None, args)
    monkeypatch.setattr(mtpc, "generate", _Planted(model, at=5, rank=1))
    ok, detail = script.check_greedy(model, args)
    assert ok is False and "float32 must be exact: first difference at token 5" in detail


# -- the compiled engine's lines --------------------------------------------------------------
@pytest.fixture
def compiled_lines(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The script with one batch size (B = 1: two to four graphs a line, dynamo's ``eager``
    backend: the same one graph as inductor's, traced in seconds), four prompts (lengths
    of one to three prefill chunks) and fresh dynamo state."""
    import torch

    script = _script()
    monkeypatch.setattr(script, "SIZES", (1,))
    monkeypatch.setattr(script, "COMPILED_LENGTHS", (3, 40, 17, 70))
    torch._dynamo.reset()
    yield script
    torch._dynamo.reset()


def _compiled_model(script: ModuleType, *argv: str) -> tuple[Any, Any]:
    args = script.parse_args(["--device", "cpu", "--compile", "eager", "--new-tokens", "8", *argv])
    return script.draft_model("tiny", None, args), args


def _corrupt_row_zero(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    """The compiled step's logits of the engine's row 0 pushed towards id 7 (B = 1: every
    prompt's row), where eager decoding picks the target's own tokens; ``model``'s engines
    (their graphs of the step before) dropped."""
    import torch

    from mtpc.decoding.static import StaticEngine, drop_engines

    step = StaticEngine.step

    def corrupted(self: Any, *args: Any) -> Any:
        trunk, logits = step(self, *args)  # (B, T, d), (B, T, V)
        bump = torch.zeros_like(logits)
        bump[0, :, 7] = 50.0
        return trunk, logits + bump

    monkeypatch.setattr(StaticEngine, "step", corrupted)
    drop_engines(model)


def test_a_corrupted_compiled_logit_row_fails(
    compiled_lines: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, args = _compiled_model(compiled_lines)
    ok, detail = compiled_lines.compare_compiled(model, args, "autoregressive", True)
    assert ok is True and "tokens identical" in detail, detail
    _corrupt_row_zero(monkeypatch, model)
    ok, detail = compiled_lines.compare_compiled(model, args, "autoregressive", True)
    assert ok is False and "compiled 7 vs eager" in detail and "must be exact" in detail, detail


def test_a_compiled_chain_that_skips_the_rewind_fails(
    compiled_lines: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rejected drafts' slots left valid: the chain's next passes read them."""
    from mtpc.decoding.static import StaticEngine

    monkeypatch.setattr(StaticEngine, "rewind", lambda self, lengths: None)
    model, args = _compiled_model(compiled_lines)
    ok, detail = compiled_lines.compare_compiled(model, args, "speculative", True)
    assert ok is False and "must be exact" in detail, detail


@pytest.mark.parametrize("noise", [None, pytest.param(100.0, marks=pytest.mark.slow)])
def test_a_bf16_compiled_flip_is_weighed_by_the_tie_rule(
    compiled_lines: ModuleType, monkeypatch: pytest.MonkeyPatch, noise: float | None
) -> None:
    """bf16: the corrupted step's flips are wrong tokens against the measured noise; with
    the noise replaced by 100 (more than half the bump) each row's first flip is a counted
    tie, and the rest of the row is not compared."""
    script = compiled_lines
    model, args = _compiled_model(script, "--dtype", "bfloat16")
    _corrupt_row_zero(monkeypatch, model)
    if noise is not None:
        measure = script.one_pass_logits

        def noisy(*a: Any) -> Any:
            _, seq = measure(*a)
            return seq + noise, seq

        monkeypatch.setattr(script, "one_pass_logits", noisy)
    ok, detail = script.compare_compiled(model, args, "autoregressive", True)
    if noise is None:
        assert ok is False and "a wrong token, not a bfloat16 tie" in detail, detail
    else:
        rows = len(script.COMPILED_LENGTHS)
        assert ok is True and f"first flip of each row, {rows} bfloat16 tie(s)" in detail, detail


def test_a_flip_after_a_one_id_prompt_is_a_tie_only_when_exact() -> None:
    """No cached position to measure the noise on: noise 0, and a tie needs a zero gap."""
    import torch

    script = _script()
    model, args = _compiled_model(script)
    with torch.no_grad():
        logits = script._logits(model.backbone, torch.tensor([[5]]))[-1]  # (V,)
    top, second = logits.topk(2).indices.tolist()
    assert not script.tie_at(model, [5], top, second, args).explained
    tie = script.tie_at(model, [5], top, top, args)
    assert tie.explained and tie.noise == 0.0 and tie.gap == 0.0


def test_refused_or_unasked_compiled_lines_are_skip_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's refusal (an unsupported backbone) and ``--compile none`` (the CPU
    default) are one SKIP line per compiled line, with the reason; nothing is decoded."""
    from mtpc.decoding import static

    script = _script()
    model = _compiled_model(script)[0]
    monkeypatch.setattr(mtpc, "generate", None)  # a decode would crash: a FAIL line
    reason = "compile='eager' does not support FakeBackbone; supported: ..."
    monkeypatch.setattr(static, "supports_compile", lambda model, compile: reason)
    for argv, why in ((["--compile", "eager"], reason), ([], "--compile none")):
        report = script.Report()
        script.run_compiled_checks(
            report, "tiny", model, script.parse_args(["--device", "cpu", *argv])
        )
        assert [line.partition(":")[0] for line in report.lines] == [
            f"SKIP {name}[tiny]" for name in script.COMPILED_LINES
        ]
        assert all(why in line for line in report.lines), report.lines
    assert script.parse_args(["--device", "cuda"]).compile == "inductor"
