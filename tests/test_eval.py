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
from tests.helpers import evabyte_checkpoint, eval_cfg, make_drafts, needs_evabyte_code

V = 320  # the tiny codec's vocabulary (the prompts come from the data pipeline)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_drafts(tmp_path_factory.mktemp("drafts"))


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
    cfg = eval_cfg(tmp_path, draft=[str(drafts["btree"])], baseline=str(drafts["ff"]))
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
    cfg = eval_cfg(
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
        evaluate(eval_cfg(tmp_path))
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "last_draft.txt").write_text(str(drafts["ff"]) + "\n")
    res = evaluate(
        eval_cfg(tmp_path, num_prompt_sets=1, max_throughput=False, plots=False, greedy=False)
    )
    assert res["rows"][1]["kind"] == "ff"


@pytest.mark.parametrize(
    "over,error,match",
    [
        ({"policy": "keep"}, EvalConfigError, "policy='keep' is not allowed"),
        ({"drafting": "beam"}, EvalConfigError, "drafting='beam' is not allowed"),
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
        evaluate(eval_cfg(tmp_path, **{"draft": "/nonexistent/draft", **over}))


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
        evaluate(eval_cfg(tmp_path, draft=str(moved)))
    config["target"]["model"] = "evabyte"
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        TargetMismatchError,
        match=r"model\.name='tiny' contradicts draft .*, exported for model\.name='evabyte'",
    ):  # python eval.py draft=<evabyte draft> model=tiny
        evaluate(eval_cfg(tmp_path, draft=str(moved)), explicit_model={"name": "tiny"})


def test_the_target_comes_from_the_draft(tmp_path: Path, drafts: dict[str, Path]) -> None:
    """``python eval.py draft=<d>`` evaluates against the recorded target whatever ``model``
    holds; an explicit override that restates it is accepted, one that contradicts it is
    refused before any work, naming the field and both values."""
    from hydra import compose, initialize_config_dir

    from mtpc.evaluation.loading import resolve_target
    from mtpc.evaluation.settings import ModelSettings, explicit_model_fields

    recorded = json.loads((drafts["ff"] / "config.json").read_text())["target"]
    cfg = eval_cfg(tmp_path, draft=str(drafts["ff"]), num_prompt_sets=1, max_throughput=False,
               plots=False, model={"name": "evabyte", "path": "EvaByte/EvaByte-SFT", "revision": None,
                      "dtype": "bfloat16", "codec": "evabyte"})  # fmt: skip
    res = evaluate(cfg)  # not explicit: the model section is a default, the draft decides
    assert res["rows"][1]["kind"] == "ff"
    manifest = json.loads((Path(res["folder"]) / "manifest.json").read_text())
    assert manifest["target"]["name"] == "hf" and manifest["target"]["path"] == recorded["path"]
    same = {"name": "hf", "path": recorded["path"]}
    configured = ModelSettings.from_fields(cfg["model"])
    assert resolve_target(configured, [drafts["ff"]], same).path == recorded["path"]
    with pytest.raises(TargetMismatchError, match=r"model\.path='/elsewhere' contradicts draft"):
        evaluate(cfg, explicit_model={"path": "/elsewhere"})
    with pytest.raises(TargetMismatchError, match="one evaluation has one target"):
        evaluate(eval_cfg(tmp_path, draft=[str(drafts["ff"]), str(drafts["other"])]))
    # the command line's model fields: model=<group> sets the name, model.<field> that field
    configs = Path(__file__).resolve().parents[1] / "configs"
    overrides = ["draft=d", "model=evabyte", "model.path=/ckpt", "+model.extra=1", "seed=3"]
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        composed = compose(config_name="eval", overrides=overrides)
    assert explicit_model_fields(overrides, composed) == {
        "name": "evabyte", "path": "/ckpt", "extra": 1,
    }  # fmt: skip
    assert explicit_model_fields(["draft=d", "seed=3"], composed) == {}


def test_an_evabyte_draft_evaluates_without_model_overrides(tmp_path: Path) -> None:
    """A draft of a (fixture) EvaByte checkpoint: ``draft=`` alone loads EvaByte from the
    recorded path, with the EvaByte group's codec and attention path; greedy SD = AR."""
    from mtpc.backbones import load_backbone
    from tests.fake_checkpoints import eva_checkpoint

    folder, _ = eva_checkpoint(tmp_path, None)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 512  # room for the chat prompts
    (folder / "config.json").write_text(json.dumps(config))
    backbone = load_backbone("evabyte", path=str(folder), dtype="float32")
    draft = MTPCModel.from_backbone(backbone, "ff", 4, 1).save_pretrained(
        tmp_path / "eva" / "draft"
    )
    cfg = eval_cfg(tmp_path, draft=str(draft), num_prompt_sets=1, max_throughput=False, plots=False,
               max_new_tokens=24)  # fmt: skip
    res = evaluate(cfg)  # cfg.model is the tiny default: the draft's target wins
    ar, eva = res["rows"]
    assert eva["prompts"] == ar["prompts"] == 2 and eva["exact"] == "2/2"  # greedy SD = AR
    manifest = json.loads((Path(res["folder"]) / "manifest.json").read_text())
    target = manifest["target"]
    assert target["name"] == "evabyte" and target["path"] == str(folder)
    assert target["codec"] == "evabyte" and target["attention_impl"] == "auto"
    # restating the target is fine; contradicting its dtype is refused before loading
    again = {**cfg, "output_dir": str(tmp_path / "out2")}  # attention_impl: another folder
    res = evaluate(
        again, explicit_model={"name": "evabyte", "path": str(folder), "attention_impl": "torch"}
    )
    assert (
        json.loads((Path(res["folder"]) / "manifest.json").read_text())["target"]["attention_impl"]
        == "torch"
    )
    with pytest.raises(TargetMismatchError, match=r"model\.dtype='bfloat16' contradicts"):
        evaluate(cfg, explicit_model={"dtype": "bfloat16"})


@pytest.mark.slow
def test_hetero_drafter_rows_report_speedup_and_vocabulary_overlap(tmp_path: Path) -> None:
    """eval.py drafter=hetero: a BPE drafter for the byte-level tiny target."""
    drafter = {
        "name": "hetero", "model": "fixture:bpe", "tokenizer": None, "algorithm": "slem",
        "lookahead": 3, "look_behind": 8, "max_psi_paths": 4096, "psi": "auto",
    }  # fmt: skip
    res = evaluate(eval_cfg(tmp_path, drafter=drafter, max_throughput=False, plots=False))
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
        rebuilt = evaluate(eval_cfg(tmp_path, report=str(folder), plots=False))
    assert [r["name"] for r in rebuilt["rows"]] == ["AR (target)", "hetero:slem"]
    for got, want in zip(rebuilt["rows"], res["rows"], strict=True):
        assert got == want
    assert rebuilt["by_source"] == res["by_source"]
    assert rebuilt["table"] == res["table"]
    # the same drafter's rows in two merged folders would be counted twice: refused
    shutil.copytree(folder, tmp_path / "copy")
    with pytest.raises(RecordsError, match="drafter:fixture:bpe was evaluated in both"):
        evaluate(
            eval_cfg(
                tmp_path,
                report=[str(folder), str(tmp_path / "copy")],
                output_dir=str(tmp_path / "m"),
            )
        )


def test_cuda_device_index_is_made_current_and_read(
    tmp_path: Path, drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device=cuda:1``: GPU 1 becomes the current device before any loading, and the
    memory counters are synchronised, reset and read on GPU 1 (torch.cuda mocked)."""
    from mtpc.evaluation import run

    calls: list[tuple[str, Any]] = []

    class Stop(Exception):
        pass

    def record(name: str, result: Any = None) -> Any:
        def fn(device: Any = None) -> Any:
            calls.append((name, device))
            return result

        return fn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("peak", 3 * 2**20))
    run.sync_memory_reset("cuda:1")
    assert run.peak_memory_mb("cuda:1") == 3.0
    run.sync_memory_reset("cuda")  # no index: the current device
    assert calls == [
        ("synchronize", 1),
        ("reset", 1),
        ("peak", 1),
        ("synchronize", 0),
        ("reset", 0),
    ]
    calls.clear()
    run.sync_memory_reset("cpu")
    assert calls == []

    def set_device(device: Any) -> None:
        calls.append(("set_device", device))
        raise Stop  # evaluate got this far: nothing loaded yet

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with (
        mock.patch("mtpc.evaluation.run.load_for_eval", side_effect=AssertionError("loaded")),
        pytest.raises(Stop),
    ):
        evaluate(eval_cfg(tmp_path, draft=str(drafts["ff"]), device="cuda:1"))
    assert calls == [("set_device", 1)]


def test_warmup_covers_a_window_crossing_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """On EvaByte (W = 16) the warm-up adds a prompt of 2W - h ids whose prefill compresses a
    window and whose decoding reaches the next boundary: both compressions happen untimed."""
    from types import SimpleNamespace

    import mtpc
    from mtpc.evaluation.run import warmup_prompts
    from tests.fakes import fake_evabyte

    torch.manual_seed(0)
    model = MTPCModel.from_hf(fake_evabyte(2, window_size=16, chunk_size=4), "ff", 4, 1)
    sets = [[SimpleNamespace(prompt_ids=list(range(70, 70 + n))) for n in (5, 9)]]
    first, long = warmup_prompts(model, sets, 24, True)
    assert first == list(range(70, 75)) and len(long) == 2 * 16 - 8
    assert long[:9] == list(range(70, 79))  # the longest prompt, repeated
    assert warmup_prompts(model, sets, 24, False) == [first]
    tiny = MTPCModel.from_hf(_save_target_in_memory(), "ff", 4, 1)
    assert warmup_prompts(tiny, sets, 24, True) == [first]  # no attention window: the first prompt
    compressions = []
    backbone = model.backbone
    compress = backbone._compress
    monkeypatch.setattr(backbone, "_compress", lambda *a: compressions.append(a[0]) or compress(*a))
    for method in ("autoregressive", "speculative"):
        compressions.clear()
        mtpc.generate(model, long, max_new_tokens=24, method=method)
        layers = backbone.num_layers
        assert len(compressions) >= 2 * layers  # the prefill's window and the next one
        compressions.clear()
        mtpc.generate(model, first, max_new_tokens=24, method=method)
        assert len(compressions) <= layers  # the first prompt alone compresses less


def _save_target_in_memory() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("interleave", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_batched_evaluation_records_the_rows_of_batch_1(
    tmp_path: Path, drafts: dict[str, Path], interleave: bool
) -> None:
    """``batch_size=4`` (8 prompts: places refilled) records, per pass and prompt, the
    output of ``batch_size=1`` (greedy: every draft equal to AR, checked), in another folder;
    the rows' times add up (a batch's shares), so tok/s stays a throughput."""
    base = {"draft": [str(drafts["btree"])], "baseline": str(drafts["ff"]),
            "num_prompts": 8, "num_prompt_sets": 1, "max_throughput": False, "plots": False,
            "interleave": interleave}  # fmt: skip
    one = evaluate(eval_cfg(tmp_path, **base, output_dir=str(tmp_path / "one")))
    many = evaluate(eval_cfg(tmp_path, **base, batch_size=4, output_dir=str(tmp_path / "many")))
    assert one["folder"] != many["folder"]
    assert "batch_size=4" in many["table"] and "batch_size" not in one["table"]

    def outputs(res: dict) -> dict:
        records = [json.loads(x) for x in (Path(res["folder"]) / "records.jsonl").open()]
        return {(r["pass"], r["draft"], r["index"]): r["tokens_sha1"]
                for r in records if r.get("type") == "prompt"}  # fmt: skip

    assert outputs(many) == outputs(one) and len(outputs(one)) == 3 * 8
    for row in many["rows"][1:]:
        assert row["exact"] == "8/8" and row["tok_s"] > 0
    assert many["rows"][0]["tok_s"] > 0


@needs_evabyte_code
def test_batched_evaluation_of_an_evabyte_draft_records_the_rows_of_batch_1(
    tmp_path: Path,
) -> None:
    """EvaByte (a tiny checkpoint of its real code, EVA window 16) at ``batch_size=2``
    records, sampled, every pass's output of ``batch_size=1`` (it refused batches before its
    rows had their own EVA windows)."""
    from mtpc.backbones import load_backbone

    path = str(evabyte_checkpoint(tmp_path / "ckpt"))
    backbone = load_backbone("evabyte", path=path, dtype="float32", attention_impl="torch")
    model = MTPCModel.from_backbone(backbone, "cp", 4, 2, lora_layers=1)
    with torch.no_grad():
        for p in model.backbone.lora.parameters():
            p.normal_(0, 0.05)
    draft = model.save_pretrained(tmp_path / "draft")
    eva = {"name": "evabyte", "path": path, "revision": None, "dtype": "float32",
           "codec": "evabyte"}  # fmt: skip
    base = {"model": eva, "draft": [str(draft)], "greedy": False, "num_prompts": 5,
            "num_prompt_sets": 1, "max_new_tokens": 24, "plots": False}  # fmt: skip

    def outputs(size: int) -> dict:
        cfg = eval_cfg(tmp_path, **base, batch_size=size, output_dir=str(tmp_path / str(size)))
        cfg["data"]["codec"] = "evabyte"
        res = evaluate(cfg)
        records = [json.loads(x) for x in (Path(res["folder"]) / "records.jsonl").open()]
        return {(r["pass"], r["draft"], r["index"]): r["tokens_sha1"]
                for r in records if r.get("type") == "prompt"}  # fmt: skip

    one = outputs(1)
    assert outputs(2) == one and len(one) == 3 * 5


def test_compile_runs_every_pass_on_the_compiled_engine_and_records_it(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    """``compile=aot_eager`` (no C compiler needed): the AR pass and the draft's chain passes
    (speculative, max_throughput) run the static compiled step (every record says
    ``compiled``), their outputs equal the eager evaluation's, the greedy drafts still equal
    AR's outputs, the folder is another than the eager baseline's and the title says so. A
    compile switch that changed nothing would leave ``eager`` in the records."""
    base = {"draft": [str(drafts["btree"])], "num_prompt_sets": 1, "plots": False}
    eager = evaluate(eval_cfg(tmp_path, **base, output_dir=str(tmp_path / "eager")))
    compiled = evaluate(
        eval_cfg(tmp_path, **base, compile="aot_eager", output_dir=str(tmp_path / "compiled"))
    )
    assert compiled["folder"] != eager["folder"]
    assert "AR compiled (aot_eager)" in compiled["table"] and "compiled" not in eager["table"]

    def records(res: dict) -> list[dict]:
        lines = (Path(res["folder"]) / "records.jsonl").open()
        return [r for r in map(json.loads, lines) if r.get("type") == "prompt"]

    engines = {(r["pass"], r["engine"]) for r in records(compiled)}
    assert engines == {("ar", "compiled"), ("speculative", "compiled"),
                       ("max_throughput", "compiled")}  # fmt: skip
    assert {r["engine"] for r in records(eager)} == {"eager"}
    same = {(r["pass"], r["index"]): r["tokens_sha1"] for r in records(eager)}
    assert {(r["pass"], r["index"]): r["tokens_sha1"] for r in records(compiled)} == same
    assert compiled["rows"][1]["exact"] == "2/2"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("maybe", r"^compile='maybe' is not allowed; allowed: True, False, 'inductor'"),
        (True, r"^compile=True needs a C compiler for torch.compile's inductor backend"),
    ],
)
def test_a_compile_that_cannot_work_is_refused_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any, message: str
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C compiler on the PATH
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(EvalConfigError, match=message):
        evaluate(eval_cfg(tmp_path, compile=value))
