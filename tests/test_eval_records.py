"""Evaluation records: a killed run resumes to the same table, reports rebuilt and merged from
records, refusals on changed settings, progress output, source selection, strict JSON."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpc.decoding.common import GenerationResult
from mtpc.evaluation.metrics import prompt_record, set_metrics
from mtpc.evaluation.records import RecordsError, read_records
from mtpc.evaluation.report import TIMING, write_outputs
from mtpc.evaluation.run import EvalConfigError, evaluate
from tests.helpers import eval_cfg, make_drafts

ROOT = Path(__file__).resolve().parents[1]
RUN = "import json, sys; from mtpc.evaluation.run import evaluate; evaluate(json.load(open(sys.argv[1])))"
UNTIMED = ("mu_acc", "mu_acc_drafts", "acceptance", "prompts", "exact", "kind", "name", "window")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_drafts(tmp_path_factory.mktemp("drafts"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _spawn(cfg: dict[str, Any], tmp_path: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
    path = tmp_path / f"cfg-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", RUN, str(path)], cwd=ROOT, env=env, **kwargs)


def _untimed(row: dict[str, Any]) -> dict[str, Any]:
    """A row without the fields that depend on timing or memory."""
    out = {k: row.get(k) for k in UNTIMED}
    out["per_set"] = [
        {k: v for k, v in m.items() if k not in TIMING and k != "mu_lat"} for m in row["per_set"]
    ]
    return json.loads(json.dumps(out).replace("NaN", "null"))


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _prompt_records(folder: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(folder) if r["type"] == "prompt"]


@pytest.mark.slow
def test_killed_evaluation_resumes_to_the_uninterrupted_table(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    """SIGKILL midway (and a half-written last line): the rerun decodes only the rest."""
    over = {"draft": [str(drafts["btree"])], "baseline": str(drafts["ff"]), "plots": False}
    killed = eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "killed"))
    records = tmp_path / "killed" / "records.jsonl"
    proc = _spawn(killed, tmp_path)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if records.is_file() and records.read_text().count('"type":"prompt"') >= 7:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, "the evaluation ended before it could be killed"
    before = _prompt_records(tmp_path / "killed")
    total = 4 * (1 + 2 + 2)  # 2 sets x 2 prompts x (AR + btree sd/max + ff sd/max)
    assert 7 <= len(before) < total
    with open(records, "ab") as f:  # a kill in the middle of a write
        f.write(b'{"type":"prompt","draft":"btr')

    resumed = evaluate(killed)
    after = _prompt_records(tmp_path / "killed")
    keys = [(r["draft_path"], r["pass"], r["set"], r["index"]) for r in after]
    assert len(after) == total and len(set(keys)) == total  # nothing decoded twice
    assert after[: len(before)] == before  # the records of the killed run were kept

    whole = evaluate(eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "whole")))
    assert [_untimed(r) for r in resumed["rows"]] == [_untimed(r) for r in whole["rows"]]
    assert [r["name"] for r in resumed["rows"]] == ["AR (target)", "btree", "ff"]
    strip = [{k: r[k] for k in ("name", "source", "prompts", "mu_acc")} for r in whole["by_source"]]
    assert strip == [{k: r[k] for k in strip[0]} for r in resumed["by_source"]]


def test_records_add_up_to_the_table_and_rebuild_it_without_decoding(
    tmp_path: Path, drafts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    res = evaluate(eval_cfg(tmp_path, draft=[str(drafts["btree"])], max_new_tokens=5, plots=False))
    folder = Path(res["folder"])
    recs = _prompt_records(folder)
    by_pass: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for r in recs:
        by_pass.setdefault((r["draft_path"], r["pass"]), []).append(r)
        assert {"prompt_id", "source", "seed", "new_tokens", "cycles", "seconds"} <= r.keys()
        if r["pass"] == "speculative":
            assert len(r["accepted"]) == r["cycles"] == len(r["drafted"])
            assert sum(r["accepted"]) == r["accepted_total"] <= r["new_tokens"] <= 5
            assert r["equal_reference"] is not None  # greedy: checked against AR
    ar, btree = res["rows"]
    sd = by_pass[(str(drafts["btree"]), "speculative")]
    for row, group in ((btree, sd), (ar, by_pass[(None, "ar")])):
        per_set = []
        for k in (0, 1):
            part = [r for r in group if r["set"] == k]
            per_set.append(sum(r["new_tokens"] for r in part) / sum(r["cycles"] for r in part))
        assert row["mu_acc"] == pytest.approx(sum(per_set) / 2)
        assert row["prompts"] == len(group) == 4
    drafts_per_set = [
        sum(r["accepted_total"] for r in sd if r["set"] == k)
        / sum(r["cycles"] for r in sd if r["set"] == k)
        for k in (0, 1)
    ]
    assert btree["mu_acc_drafts"] == pytest.approx(sum(drafts_per_set) / 2)
    assert btree["mu_acc_drafts"] <= btree["mu_acc"]  # only emitted drafts count
    assert btree["exact"] == f"{sum(r['equal_reference'] for r in sd)}/4"
    assert sum(r["prompts"] for r in res["by_source"]) == 4
    saved = _strict(Path(res["files"]["json"]).read_text())  # strict JSON: no NaN
    session = saved["provenance"][0]
    for key in ("device_name", "torch", "transformers", "mtpc", "git_commit", "num_threads"):
        assert key in session
    assert session["date"] and session["num_threads"] == 1
    capsys.readouterr()

    rebuilt = evaluate(eval_cfg(tmp_path, report=str(folder), plots=False))
    assert rebuilt["table"] == res["table"] and rebuilt["source_table"] == res["source_table"]
    assert rebuilt["table"] in capsys.readouterr().out
    assert _prompt_records(folder) == recs  # nothing decoded


def test_same_command_resumes_its_folder_and_other_settings_get_their_own(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    over = {"draft": str(drafts["ff"]), "num_prompt_sets": 1, "max_throughput": False}
    first = evaluate(eval_cfg(tmp_path, **over, output_dir=None, plots=False))
    folder = Path(first["folder"])
    assert folder.parent == tmp_path / "outputs" / "eval" and folder.name.startswith("ff-greedy-")
    again = evaluate(eval_cfg(tmp_path, **over, output_dir=None, plots=False))
    assert again["folder"] == first["folder"] and again["table"] == first["table"]
    other = evaluate(eval_cfg(tmp_path, **over, output_dir=None, plots=False, max_new_tokens=8))
    assert other["folder"] != first["folder"]
    assert (folder / "results.json").is_file()  # the first evaluation's results are kept

    with pytest.raises(RecordsError, match=r"settings\.max_new_tokens: 16 -> 8.*resume=force"):
        evaluate(eval_cfg(tmp_path, **over, output_dir=str(folder), max_new_tokens=8))
    forced = evaluate(
        eval_cfg(tmp_path, **over, output_dir=str(folder), max_new_tokens=8, resume="force")
    )
    assert forced["rows"][1]["prompts"] == 2  # the records were kept, nothing re-decoded


def test_a_changed_default_draft_rule_is_another_measurement(
    tmp_path: Path, drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest names the rule each draft decodes with (no ``proposal``: the family's
    default), so when a default changes the same command measures afresh in another folder
    instead of resuming records decoded with the old one; the old folder is untouched."""
    from mtpc.decoding import settings

    over = {"draft": str(drafts["btree"]), "num_prompt_sets": 1, "max_throughput": False,
            "plots": False, "output_dir": None, "greedy": False}  # fmt: skip
    first = evaluate(eval_cfg(tmp_path, **over))
    folder = Path(first["folder"])
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [d["draft_rule"] for d in manifest["drafts"]] == ["zsample1"]
    assert {r["draft_rule"] for r in _prompt_records(folder) if "draft_rule" in r} == {"zsample1"}
    monkeypatch.setitem(settings.DEFAULT_SAMPLING_PROPOSAL, "btree", "path")
    second = evaluate(eval_cfg(tmp_path, **over))
    assert Path(second["folder"]) != folder
    assert {
        r["draft_rule"] for r in _prompt_records(Path(second["folder"])) if "draft_rule" in r
    } == {"zsample"}
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def test_an_older_folder_reads_draft_mode_as_draft_rule(tmp_path: Path) -> None:
    """Folders written before the rename stay readable (``report=``, resume): their
    ``draft_mode`` (a manifest's draft, a record) comes back as ``draft_rule``."""
    from mtpc.evaluation.records import read_manifest

    drafts = [{"path": "d", "draft_mode": "zmap"}]
    (tmp_path / "manifest.json").write_text(json.dumps({"drafts": drafts}))
    (tmp_path / "records.jsonl").write_text(
        json.dumps({"type": "pass", "draft_mode": "map"}) + "\n"
    )
    assert read_manifest(tmp_path)["drafts"] == [{"path": "d", "draft_rule": "zmap"}]
    assert read_records(tmp_path) == [{"type": "pass", "draft_rule": "map"}]


def test_resume_never_measures_again_in_a_new_folder(
    tmp_path: Path, drafts: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    over = {"draft": str(drafts["ff"]), "num_prompt_sets": 1, "max_throughput": False,
            "plots": False, "output_dir": None}  # fmt: skip
    first = evaluate(eval_cfg(tmp_path, **over))
    folder = Path(first["folder"])
    with caplog.at_level("INFO", logger="mtpc.evaluation.run"):
        evaluate(eval_cfg(tmp_path, **over))  # the same command: nothing decoded
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert re.search(
        rf"ff: already recorded in {re.escape(str(folder))} \(resume=never", caplog.text
    )
    fresh = evaluate(eval_cfg(tmp_path, **over, resume="never"))
    assert Path(fresh["folder"]) == folder.with_name(folder.name + "-2")
    again = _prompt_records(Path(fresh["folder"]))
    assert len(again) == len(_prompt_records(folder)) == 4  # AR + speculative, 2 prompts each
    assert [r["tokens_sha1"] for r in again] == [r["tokens_sha1"] for r in _prompt_records(folder)]
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    third = evaluate(eval_cfg(tmp_path, **over, resume="never"))
    assert Path(third["folder"]).name == folder.name + "-3"


def test_merged_report_and_refusals(tmp_path: Path, drafts: dict[str, Path]) -> None:
    """One folder per draft (a SLURM array) merges into one table; mismatches are refused."""
    over = {"num_prompt_sets": 1, "max_throughput": False, "plots": False}
    a = evaluate(
        eval_cfg(tmp_path, **over, draft=str(drafts["btree"]), output_dir=str(tmp_path / "a"))
    )
    b = evaluate(
        eval_cfg(tmp_path, **over, draft=str(drafts["ff"]), output_dir=str(tmp_path / "b"))
    )
    merged = evaluate(
        eval_cfg(tmp_path, report=[str(tmp_path / "a"), "b"], output_dir=str(tmp_path / "m"))
    )
    assert [r["name"] for r in merged["rows"]] == ["AR (target)", "btree", "ff"]
    assert _untimed(merged["rows"][1]) == _untimed(a["rows"][1])
    assert _untimed(merged["rows"][2]) == _untimed(b["rows"][1])
    assert "2 folders merged" in merged["table"] and (tmp_path / "m" / "results.json").is_file()
    globbed = evaluate(
        eval_cfg(tmp_path, report=str(tmp_path / "[ab]"), output_dir=str(tmp_path / "g"))
    )
    assert globbed["table"] == merged["table"]

    for field, value, match in (
        ("settings", {"max_new_tokens": 32}, r"settings\.max_new_tokens: 16 -> 32"),
        ("device_name", "another GPU", "device_name"),
        ("target", {"name": "evabyte"}, r"target\.name: 'hf' -> 'evabyte'"),
    ):
        shutil.rmtree(tmp_path / "c", ignore_errors=True)
        shutil.copytree(tmp_path / "b", tmp_path / "c")
        manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
        manifest[field] = {**manifest[field], **value} if isinstance(value, dict) else value
        manifest["drafts"] = []
        (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(RecordsError, match=f"cannot merge .*{match}"):
            evaluate(eval_cfg(tmp_path, report=["a", "c"], output_dir=str(tmp_path / "m")))
    shutil.copytree(tmp_path / "a", tmp_path / "a2")
    with pytest.raises(RecordsError, match="evaluated in both"):
        evaluate(eval_cfg(tmp_path, report=["a", "a2", "b"], output_dir=str(tmp_path / "m")))
    with pytest.raises(EvalConfigError, match="output_dir"):
        evaluate(eval_cfg(tmp_path, report=["a", "b"], output_dir=None))


def test_sources_select_prompts_and_unknown_names_list_the_available(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    over = {"draft": str(drafts["ff"]), "num_prompt_sets": 1, "max_throughput": False}
    res = evaluate(eval_cfg(tmp_path, **over, sources=["synthetic/multi_answer"], plots=False))
    sources = {r["source"] for r in _prompt_records(Path(res["folder"]))}
    assert sources == {"synthetic/multi_answer"}
    assert [r["source"] for r in res["by_source"]] == ["synthetic/multi_answer"]
    assert "sources=synthetic/multi_answer" in res["table"]
    with pytest.raises(EvalConfigError, match=r"'synthetic/nope'; available: .*synthetic/arithm"):
        evaluate(
            eval_cfg(tmp_path, **over, sources=["synthetic/nope"], output_dir=str(tmp_path / "no"))
        )


def test_acc_drafts_counts_only_the_emitted_drafts() -> None:
    """max_new_tokens = 5 cuts a cycle that accepted 8 drafts: 4 of them are emitted."""
    cut = GenerationResult(
        tokens=list(range(5)), accepted=[8], emitted=[5], drafted=[8], offsets=[0],
        cycle_seconds=[0.1], seconds=0.1,
    )  # fmt: skip
    m = set_metrics([prompt_record(cut)], window=8)
    assert m["mu_acc"] == 5 and m["mu_acc_drafts"] == 5  # the 5 emitted tokens are drafts
    assert m["acceptance"][:5] == [1.0] * 5
    assert all(a != a for a in m["acceptance"][5:])  # positions 6..8 were never emitted


def test_results_json_is_strict_json(tmp_path: Path) -> None:
    """NaN (an acceptance position no cycle reached, an empty ratio) is written as null."""
    nan = float("nan")
    row = {"name": "x", "kind": "btree", "mu_lat": 0.1, "mu_acc": 2.0, "tok_s": 20.0,
           "speedup_ar": nan, "acceptance": [1.0, nan], "per_set": []}  # fmt: skip
    files = write_outputs({"rows": [row], "by_source": []}, tmp_path, plots=False)
    saved = _strict(Path(files["json"]).read_text())
    assert saved["rows"][0]["speedup_ar"] is None and saved["rows"][0]["acceptance"] == [1.0, None]


@pytest.mark.slow
def test_progress_bar_on_a_terminal_leaves_the_table_intact(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    """stdout and stderr on one pseudo-terminal: the bar shows, then the table reads whole."""
    cfg = eval_cfg(
        tmp_path, draft=str(drafts["ff"]), num_prompt_sets=1, max_throughput=False, plots=False
    )
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    proc = _spawn(cfg, tmp_path, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    raw = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        try:
            chunk = os.read(leader, 65536) if ready else b""
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            break
        raw += chunk
    os.close(leader)
    assert proc.wait() == 0
    text = raw.decode(errors="replace").replace("\r\n", "\n")
    assert re.search(r"ff \[speculative\].*prompt", text), "no progress bar on a terminal"
    shown = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]  # what a terminal shows
    table = json.loads((Path(cfg["output_dir"]) / "results.json").read_text())["table"]
    lines = table.splitlines()
    start = shown.index(lines[0])
    assert shown[start : start + len(lines)] == lines


@pytest.mark.slow
def test_killed_hetero_evaluation_resumes_per_prompt(tmp_path: Path) -> None:
    """drafter=hetero rows are recorded per prompt: SIGKILL midway, the rerun decodes the rest."""
    drafter = {
        "name": "hetero", "model": "fixture:bpe", "tokenizer": None, "algorithm": "slem",
        "lookahead": 3, "look_behind": 8, "max_psi_paths": 4096, "psi": "auto",
    }  # fmt: skip
    over = {"drafter": drafter, "max_throughput": False, "plots": False}
    killed = eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "killed"))
    records = tmp_path / "killed" / "records.jsonl"
    proc = _spawn(killed, tmp_path)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if records.is_file() and records.read_text().count('"type":"prompt"') >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, "the evaluation ended before it could be killed"
    before = _prompt_records(tmp_path / "killed")
    total = 2 * 2 * 2  # 2 sets x 2 prompts x (target alone + hetero drafter)
    assert 3 <= len(before) < total and {r["pass"] for r in before} <= {"hetero_ar", "hetero"}
    with open(records, "ab") as f:  # a kill in the middle of a write
        f.write(b'{"type":"prompt","draft":"hetero:sl')

    resumed = evaluate(killed)
    after = _prompt_records(tmp_path / "killed")
    keys = [(r["draft_path"], r["pass"], r["set"], r["index"]) for r in after]
    assert len(after) == total and len(set(keys)) == total  # nothing decoded twice
    assert after[: len(before)] == before  # the killed run's records were kept
    assert all(r["draft_path"] == "drafter:fixture:bpe" for r in after)

    whole = evaluate(eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "whole")))
    untimed = ("mu_acc", "mu_acc_drafts", "cycles", "tokens", "drafter_passes_per_cycle")
    for got, want in zip(resumed["rows"], whole["rows"], strict=True):
        assert got["name"] == want["name"] and got.get("overlap") == want.get("overlap")
        assert [{k: m[k] for k in untimed} for m in got["per_set"]] == [
            {k: m[k] for k in untimed} for m in want["per_set"]
        ]
    assert [r["name"] for r in resumed["rows"]] == ["AR (target)", "hetero:slem"]
    # the rows are the records: tokens per target pass of set 0, from the lines alone
    set0 = [r for r in after if r["pass"] == "hetero" and r["set"] == 0]
    mu_acc = sum(r["new_tokens"] for r in set0) / sum(r["cycles"] for r in set0)
    assert resumed["rows"][1]["per_set"][0]["mu_acc"] == pytest.approx(mu_acc)
