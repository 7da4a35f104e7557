"""One model-free settings check, one stop rule, one heterogeneous harness (issue 27)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import mtpc
from mtpc.decoding.common import GenerationResult, cut_at_stop
from mtpc.decoding.settings import DecodingSettings, SettingsError, check_settings
from mtpc.evaluation.hetero import MemoryRecords, run_hetero_passes

REPO = Path(__file__).resolve().parents[1]

BAD = [
    ({"top_p": 1.5}, r"^top_p=1\.5 is not allowed; allowed: a number in \(0, 1\] or None$"),
    ({"top_k": 0}, r"^top_k=0 is not allowed; allowed: an integer >= 1$"),
    ({"seed": -1}, r"^seed=-1 is not allowed; allowed: an integer >= 0$"),
    ({"temperature": math.nan}, r"^temperature=nan is not allowed; allowed: a number > 0$"),
    ({"greedy": "yes"}, r"^greedy='yes' is not allowed; allowed: True, False$"),
]


def _refusal(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_the_three_callers_refuse_a_setting_with_one_line(bad: dict, message: str) -> None:
    """mtpc.generate, mtpc.generate_hetero and evaluate: the same line, before any model."""
    from mtpc.evaluation.run import evaluate

    # no model at all: the check runs before the model or the tokenizers are touched
    by_generate = _refusal(lambda: mtpc.generate(None, [1, 2], **bad))
    by_hetero = _refusal(lambda: mtpc.generate_hetero(None, None, None, None, "hi", **bad))
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("eval", overrides=[f"{k}={v}" for k, v in bad.items()])
    by_evaluate = _refusal(lambda: evaluate(cfg))
    assert by_generate == by_hetero == by_evaluate
    assert "\n" not in by_generate
    with pytest.raises(SettingsError, match=message):
        check_settings(**bad)


def test_settings_are_checked_without_torch() -> None:
    import subprocess
    import sys

    code = "import mtpc.decoding.settings, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_checked_settings() -> None:
    s = check_settings(top_p=1, stop_ids=(3, 4), greedy=False, proposal="path")
    assert isinstance(s, DecodingSettings) and s.top_p == 1.0 and s.stop_ids == (3, 4)
    assert s.rule_for("cp") == ("zsample", "path")
    with pytest.raises(SettingsError, match=r"^stop_ids contains 3\.5; allowed: integer"):
        check_settings(stop_ids=(3.5,))
    with pytest.raises(SettingsError, match=r"^max_new_tokens=0 is not allowed"):
        check_settings(max_new_tokens=0)
    check_settings(algorithm="slem", max_new_tokens=0)  # the heterogeneous decoder allows 0
    with pytest.raises(SettingsError, match=r"^drafter\.lookahead=0 is not allowed"):
        check_settings(lambda f: f"drafter.{f}", algorithm="slem", lookahead=0)
    with pytest.raises(SettingsError, match=r"^algorithm='x' is not allowed; allowed: slem, "):
        check_settings(algorithm="x")


def test_one_stop_rule() -> None:
    assert cut_at_stop([5, 6, 7, 8], 10, {7}) == ([5, 6, 7], True)
    assert cut_at_stop([5, 6, 7, 8], 2, {7}) == ([5, 6], False)  # max_new_tokens first
    assert cut_at_stop([5, 6, 7, 8], 10, {7}, ignore_stops=True) == ([5, 6, 7, 8], False)
    assert cut_at_stop([5, 6], 10, ()) == ([5, 6], False)
    assert cut_at_stop([5, 6], 0, {5}) == ([], False)


def test_one_harness_writes_and_resumes() -> None:
    from mtpc.evaluation.hetero import HeteroPrompt
    from mtpc.evaluation.report import HETERO_PASSES

    calls: list[tuple[str, list[int], int]] = []

    def decoder(pass_name: str):
        def decode(ids: list[int], seed: int) -> GenerationResult:
            calls.append((pass_name, ids, seed))
            return GenerationResult(tokens=[1, 2], accepted=[1], seconds=0.5, drafter_passes=3)

        return decode

    decoders = {p: decoder(p) for p in HETERO_PASSES}
    sets = [[HeteroPrompt("a", [9]), HeteroPrompt("b", [8])], [HeteroPrompt("c", [7])]]
    sink = MemoryRecords()
    run_hetero_passes(sink, decoders, sets, "drafter:x", "hetero:slem", seed=10, warmup=1)
    assert len(sink.records) == 6 and len(calls) == 8  # 3 prompts + 1 warm-up, per pass
    first = sink.records[0]
    assert first["draft"] == "AR (target)" and first["seed"] == 10
    assert first["cycles"] == 1 and first["drafter_passes"] == 3
    assert [r["seed"] for r in sink.records[3:]] == [10, 11, 11]  # set k, prompt i: seed + k + i
    assert {r["draft"] for r in sink.records[3:]} == {"hetero:slem"}
    calls.clear()
    run_hetero_passes(sink, decoders, sets, "drafter:x", "hetero:slem", seed=10, warmup=1)
    assert calls == [] and len(sink.records) == 6  # every prompt recorded: nothing decoded
