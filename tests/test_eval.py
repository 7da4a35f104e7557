"""The evaluator: metrics, reports, plots, the last-draft default and refusals before decoding."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtpc.decoding.common import GenerationResult
from mtpc.evaluation.metrics import aggregate, set_metrics
from mtpc.evaluation.records import RecordsError
from mtpc.evaluation.run import EvalConfigError, evaluate
from mtpc.export import TargetMismatchError
from mtpc.model import MTPCModel

V = 320  # the tiny codec's vocabulary (the prompts come from the data pipeline)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _save_target(path: Path, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_drafts(tmp_path_factory.mktemp("drafts"))


def make_drafts(root: Path) -> dict[str, Path]:
    """Untrained btree (k = 1) and ff drafts of one random target, and a cp draft of another."""
    out = {}
    for name, kind, rank, k in (("btree", "btree", 2, 1), ("ff", "ff", 1, 0)):
        hf = _save_target(root / "target", 0)
        model = MTPCModel.from_hf(hf, kind=kind, window=4, rank=rank, lora_layers=k)
        out[name] = model.save_pretrained(root / name / "draft")
    other = _save_target(root / "other_target", 1)
    out["other"] = MTPCModel.from_hf(other, kind="cp", window=4, rank=2).save_pretrained(
        root / "other" / "draft"
    )
    return out


def _cfg(tmp_path: Path, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name": "tiny", "path": None, "revision": None, "dtype": "float32", "codec": "tiny"},
        "data": {
            "_target_": "mtpc.data.datamodule.build_datamodule", "source": "synthetic",
            "num_rows": 300, "codec": "tiny", "seq_len": 256, "window": 4, "seed": 0,
            "cache_dir": str(tmp_path / "cache"), "validation_fraction": 0.1,
        },
        "paths": {"root_dir": str(tmp_path)},
        "seed": 0, "draft": None, "baseline": None, "device": "cpu", "num_threads": 1,
        "num_prompts": 2, "num_prompt_sets": 2, "english_only": True, "max_prompt_length": None,
        "max_new_tokens": 16, "warmup": 1, "greedy": True, "policy": "condition",
        "draft_mode": None, "temperature": 1.0, "top_k": None, "top_p": None,
        "suppress_eos": True, "max_throughput": True, "plots": True,
        "output_dir": str(tmp_path / "out"),
    }  # fmt: skip
    cfg.update(over)
    return cfg


def test_metrics_count_the_correction_and_acceptance_per_position() -> None:
    a = GenerationResult(
        tokens=list(range(7)), accepted=[3, 0, 2], emitted=[4, 1, 2], drafted=[4, 3, 3],
        offsets=[0, 1, 1], cycle_seconds=[0.1, 0.1, 0.2], seconds=0.5,
    )  # fmt: skip
    m = set_metrics([a], window=4)
    assert m["mu_acc"] == pytest.approx(7 / 3) and m["mu_acc_drafts"] == pytest.approx(5 / 3)
    assert m["mu_lat"] == pytest.approx(0.4 / 3)
    assert m["tok_s"] == pytest.approx(7 / 0.4)
    assert m["acceptance"] == pytest.approx([1.0, 2 / 3, 2 / 3, 0.0])
    agg = aggregate([m, {**m, "tok_s": m["tok_s"] * 3}])
    assert agg["tok_s"] == pytest.approx(2 * m["tok_s"]) and agg["tok_s_std"] > 0


def test_evaluate_drafts_with_baseline_writes_table_json_csv_plots(
    tmp_path: Path, drafts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, draft=[str(drafts["btree"])], baseline=str(drafts["ff"]))
    res = evaluate(cfg)
    printed = capsys.readouterr().out
    assert "x AR" in printed and "AR (target)" in printed
    ar, btree, ff = res["rows"]
    assert ar["mu_acc"] == 1.0 and btree["kind"] == "btree" and ff["baseline"]
    for row in (btree, ff):
        assert row["tok_s"] > 0 and row["max_tok_s"] > 0 and row["speedup_ar"] > 0
        assert len(row["acceptance"]) == 4 and len(row["per_set"]) == 2
    assert ff["speedup_baseline"] == pytest.approx(1.0)
    files = res["files"]
    for key in ("json", "csv", "tradeoff_plot", "acceptance_plot"):
        assert Path(files[key]).is_file()
    saved = json.loads(Path(files["json"]).read_text())
    assert saved["settings"]["policy"] == "condition" and len(saved["rows"]) == 3


def test_baseline_listed_among_the_drafts_is_evaluated_once(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    """``draft=[btree, ff] baseline=ff``: the FF row appears once, as the baseline."""
    cfg = _cfg(
        tmp_path,
        draft=[str(drafts["btree"]), str(drafts["ff"])],
        baseline=str(drafts["ff"]),
        num_prompt_sets=1, max_throughput=False, plots=False,
    )  # fmt: skip
    rows = evaluate(cfg)["rows"]
    assert [r.get("kind") for r in rows[1:]] == ["btree", "ff"]
    assert rows[-1]["baseline"] and rows[-1]["speedup_baseline"] == pytest.approx(1.0)


def test_default_draft_is_the_last_trained_one(tmp_path: Path, drafts: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match=r"python train\.py"):
        evaluate(_cfg(tmp_path))
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "last_draft.txt").write_text(str(drafts["ff"]) + "\n")
    res = evaluate(
        _cfg(tmp_path, num_prompt_sets=1, max_throughput=False, plots=False, greedy=False)
    )
    assert res["rows"][1]["kind"] == "ff"


@pytest.mark.parametrize(
    "over,error,match",
    [
        ({"policy": "keep"}, EvalConfigError, "policy='keep' is not allowed"),
        ({"draft_mode": "beam"}, EvalConfigError, "draft_mode='beam' is not allowed"),
        ({"temperature": 0}, EvalConfigError, "temperature=0 is not allowed"),
        ({"device": "tpu"}, EvalConfigError, "device='tpu' is not allowed"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"draft": "/nonexistent/draft"}, FileNotFoundError, "not an exported draft"),
    ],
)
def test_bad_settings_fail_before_loading(
    tmp_path: Path, over: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        evaluate(_cfg(tmp_path, **{"draft": "/nonexistent/draft", **over}))


def test_a_draft_for_another_target_is_refused(tmp_path: Path, drafts: dict[str, Path]) -> None:
    config = json.loads((drafts["other"] / "config.json").read_text())
    # point the other target's draft at the first target's weights: the fingerprint differs
    config["target"]["path"] = str(drafts["btree"].parents[1] / "target")
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in drafts["other"].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetMismatchError, match="exported for target"):
        evaluate(_cfg(tmp_path, draft=str(moved)))
    config["target"]["model"] = "evabyte"
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exported for target model 'evabyte', but model=tiny"):
        evaluate(_cfg(tmp_path, draft=str(moved)))


def test_hetero_drafter_rows_report_speedup_and_vocabulary_overlap(tmp_path: Path) -> None:
    """eval.py drafter=hetero: a BPE drafter for the byte-level tiny target."""
    drafter = {
        "name": "hetero", "model": "fixture:bpe", "tokenizer": None, "algorithm": "slem",
        "lookahead": 3, "look_behind": 8, "max_psi_paths": 4096, "psi": "auto",
    }  # fmt: skip
    res = evaluate(_cfg(tmp_path, drafter=drafter, max_throughput=False, plots=False))
    ar, slem = res["rows"]
    assert ar["kind"] == "ar" and slem["kind"] == "slem"
    assert slem["mu_acc"] >= 1.0 and slem["speedup_ar"] > 0 and len(slem["per_set"]) == 2
    assert 0 < slem["overlap"]["vocab_intersection_over_target"] <= 1
    assert slem["prompts"] == ar["prompts"] == 4
    assert {r["name"] for r in res["by_source"]} == {"hetero:slem"}
    assert sum(r["prompts"] for r in res["by_source"]) == 4

    # report= rebuilds the hetero rows from the records alone (no drafter loaded)
    folder = Path(res["folder"])
    with mock.patch("mtpc.evaluation.hetero.load_drafter", side_effect=AssertionError("loaded")):
        rebuilt = evaluate(_cfg(tmp_path, report=str(folder), plots=False))
    assert [r["name"] for r in rebuilt["rows"]] == ["AR (target)", "hetero:slem"]
    for got, want in zip(rebuilt["rows"], res["rows"], strict=True):
        assert got == want
    assert rebuilt["by_source"] == res["by_source"]
    assert rebuilt["table"] == res["table"]
    # the same drafter's rows in two merged folders would be counted twice: refused
    shutil.copytree(folder, tmp_path / "copy")
    with pytest.raises(RecordsError, match="drafter:fixture:bpe was evaluated in both"):
        evaluate(
            _cfg(
                tmp_path,
                report=[str(folder), str(tmp_path / "copy")],
                output_dir=str(tmp_path / "m"),
            )
        )
