"""Spec-Bench prompts (issue 35): ``prompts=spec_bench prompts.path=<question.jsonl>``.

The file format is Spec-Bench's (``question_id``, ``category``, ``turns``; MT-bench rows have
two turns), written here by the tests. Checked: bad files fail in one line naming the file
and line before anything loads; the second turn is asked after the model's own first answer;
greedy speculative output equals AR output per turn; per-category rows with both metric
definitions; the file's content (not its path) is in the evaluation key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from mtpc.backbones.codecs import get_codec
from mtpc.data.spec_bench import (
    SpecBenchError,
    build_prompt_sets,
    read_questions,
    select_questions,
)
from mtpc.errors import UserError
from mtpc.evaluation.folders import build_manifest
from mtpc.evaluation.records import RecordsError, folder_name, identity, read_records
from mtpc.evaluation.report import SPEC_BENCH_NOTE, spec_bench_report, title_of
from mtpc.evaluation.run import evaluate
from mtpc.evaluation.settings import EvalConfigError, parse_eval
from tests.helpers import CONFIG_DIR, REPO, eval_cfg, make_drafts

QUESTIONS = [
    {"question_id": 81, "category": "writing",
     "turns": ["Write a haiku about bytes.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Name a color.", "Why that one?"]},
    {"question_id": 111, "category": "math", "turns": ["What is 2+2?", "And times 3?"]},
    {"question_id": 161, "category": "translation",
     "turns": ["Translate German to English: Guten Tag."], "reference": ["Good day."]},
    {"question_id": 241, "category": "qa", "turns": ["Who wrote Hamlet?"]},
]  # fmt: skip


def write_questions(path: Path, rows: list[Any] = QUESTIONS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def spec_cfg(tmp_path: Path, path: Path, **over: Any) -> dict[str, Any]:
    """An evaluation config with ``prompts=spec_bench`` (as configs/prompts/spec_bench.yaml)."""
    prompts = {"name": "spec_bench", "path": str(path), "categories": None,
               "per_category": None, "turns": None}  # fmt: skip
    prompts.update(over.pop("prompts", {}))
    base = {"prompts": prompts, "num_prompts": None, "english_only": False,
            "num_prompt_sets": 1, "max_throughput": False, "plots": False}  # fmt: skip
    return eval_cfg(tmp_path, **{**base, **over})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_drafts(tmp_path_factory.mktemp("drafts"))


# --------------------------------------------------------------------------- the file ----
def test_reads_the_spec_bench_format(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "question.jsonl")
    questions, sha = read_questions(path)
    assert [q.id for q in questions] == ["81", "82", "111", "161", "241"]
    assert questions[0].turns == ("Write a haiku about bytes.", "Now make it rhyme.")
    assert questions[3].reference == "Good day." and questions[3].line == 4
    import hashlib

    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    chosen = select_questions(questions, path, ["writing", "qa"], turns=1)
    assert [(q.id, len(q.turns)) for q in chosen] == [("81", 1), ("82", 1), ("241", 1)]


BAD_FILES = [
    ('{"question_id": 1, "category": "qa", "turns": ["Hi"]}\n{"question_id": 2, "category": "qa"}\n',
     r"q\.jsonl:2: no 'turns' field"),
    ('{"question_id": 1, "category": "qa", "turns": ["Hi"]}\n\n'
     '{"question_id": 2, "category": "qa", "turns": ["Hi", "  "]}\n', r"q\.jsonl:3: turns\[1\]"),
    ('{"question_id": 1, "category": "qa", "turns": []}\n', r"q\.jsonl:1: turns=\[\] is not"),
    ('{"question_id": 1, "category": "qa", "turns": ["Hi"]\n', r"q\.jsonl:1: not JSON"),
    ('[1, 2]\n', r"q\.jsonl:1: a JSON list, not an object"),
    ('{"question_id": 1, "category": "", "turns": ["Hi"]}\n', r"q\.jsonl:1: category=''"),
    ('{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
     '{"question_id": 1, "category": "qa", "turns": ["b"]}\n', r"q\.jsonl:2: .*repeats line 1"),
    ("", r"q\.jsonl: no questions \(empty file\)"),
    ("\n  \n", r"q\.jsonl: no questions \(empty file\)"),
    (None, r"prompts\.path=.*q\.jsonl does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_a_bad_file_fails_in_one_line_before_anything_loads(
    tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "q.jsonl"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    cfg = spec_cfg(tmp_path, path, draft="/nonexistent/draft")  # the file is checked first
    with (
        mock.patch("mtpc.evaluation.run.load_for_eval", side_effect=AssertionError("loaded")),
        pytest.raises(SpecBenchError, match=message) as caught,
    ):
        evaluate(cfg)
    assert isinstance(caught.value, UserError) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_an_unknown_category_names_the_allowed_ones(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "q.jsonl")
    cfg = spec_cfg(tmp_path, path, draft="/nonexistent/draft",
                   prompts={"categories": ["writing", "poetry"]})  # fmt: skip
    with pytest.raises(SpecBenchError, match=r"'poetry'; allowed: writing, math, translation, qa$"):
        evaluate(cfg)


def test_one_category_given_as_a_word_selects_that_category(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "q.jsonl")
    data = build_manifest(spec_cfg(tmp_path, path, prompts={"categories": "writing"}), [], [])
    assert data["data"]["categories"] == ["writing"] and data["data"]["questions"] == 2


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"prompts": {"turns": 0}}, r"prompts\.turns=0 is not allowed"),
        ({"prompts": {"per_category": "all"}}, r"prompts\.per_category='all' is not allowed"),
        ({"prompts": {"categories": 3}}, r"prompts\.categories=3 is not allowed"),
        ({"prompts": {"path": None}}, r"prompts\.path=None is not allowed"),
        ({"prompts": {"name": "mt_bench"}}, r"prompts\.name='mt_bench' is not allowed"),
        ({"sources": ["synthetic/multi_answer"]}, r"sources= is not allowed with prompts"),
        ({"english_only": True}, r"english_only=true is not allowed with prompts"),
    ],
)
def test_bad_prompts_settings_are_refused(tmp_path: Path, over: dict, message: str) -> None:
    path = write_questions(tmp_path / "q.jsonl")
    with pytest.raises(EvalConfigError, match=message):
        parse_eval(spec_cfg(tmp_path, path, **over))


def test_the_config_group_takes_every_question_and_keeps_the_default_prompts() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        spec = compose("eval", overrides=["prompts=spec_bench", "prompts.path=q.jsonl",
                                          "prompts.categories=[writing,qa]"])  # fmt: skip
        default = compose("eval")
    assert spec.prompts.path == "q.jsonl" and list(spec.prompts.categories) == ["writing", "qa"]
    assert spec.num_prompts is None and spec.english_only is False
    assert default.get("prompts") is None and default.num_prompts == 8 and default.english_only
    from mtpc.config import ConfigError

    parse_eval(spec)  # num_prompts=null: every question
    with open_dict(default):
        default.num_prompts = None
    with pytest.raises(ConfigError, match="num_prompts"):  # only Spec-Bench takes null
        parse_eval(default)


def test_prompt_sets_filter_limit_and_leave_out_what_cannot_fit(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "q.jsonl")
    questions, _ = read_questions(path)
    codec = get_codec("tiny")
    sets = build_prompt_sets(questions, codec, num_sets=2, max_new_tokens=16)
    assert [p.id for p in sets[0]] == [p.id for p in sets[1]] == ["81", "82", "111", "161", "241"]
    first = sets[0][0]
    assert first.source == "writing" and first.later_turns == ("Now make it rhyme.",)
    assert first.prompt_ids == codec.generation_prompt(
        [{"role": "user", "content": "Write a haiku about bytes."}]
    )
    assert [p.seed_offset for p in sets[1]] == [5] * 5 and sets[0][0].seed_offset == 0
    per = build_prompt_sets(questions, codec, per_category=1)[0]
    assert [p.id for p in per] == ["81", "111", "161", "241"]
    assert [p.id for p in build_prompt_sets(questions, codec, num_prompts=2)[0]] == ["81", "82"]
    with pytest.raises(SpecBenchError, match=r"num_prompts=6: .* 5 questions .* 1\.\.5 or null"):
        build_prompt_sets(questions, codec, num_prompts=6)
    # a two-turn question's last prompt holds the first answer (up to 3 bytes per id): the
    # bound leaves out the long ones, and nothing when every prompt would be too long
    short = max(len(p.prompt_ids) for p in sets[0] if not p.later_turns)
    kept = build_prompt_sets(questions, codec, max_new_tokens=64, max_prompt_length=short)[0]
    assert [p.id for p in kept] == ["161", "241"]
    with pytest.raises(SpecBenchError, match="no question fits"):
        build_prompt_sets(questions, codec, max_prompt_length=5)


def test_the_evaluation_key_holds_the_file_content_not_its_path(tmp_path: Path) -> None:
    path = write_questions(tmp_path / "q.jsonl")
    copy = tmp_path / "elsewhere" / "q.jsonl"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    changed = write_questions(tmp_path / "changed.jsonl", QUESTIONS[:4])

    def key(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
        manifest = build_manifest(cfg, [], [])
        return identity(manifest), folder_name(manifest)

    spec, name = key(spec_cfg(tmp_path, path))
    assert spec == key(spec_cfg(tmp_path, copy))[0]
    assert spec["data"]["sha256"] and "specbench-1x5x16" in name
    assert spec != key(spec_cfg(tmp_path, changed))[0]
    assert spec != key(spec_cfg(tmp_path, path, prompts={"turns": 1}))[0]
    tulu = key(eval_cfg(tmp_path))
    assert tulu[0]["data"]["source"] == "synthetic" and "specbench" not in tulu[1]


def _record(pass_name: str, qid: str, category: str, tokens: int, seconds: float,
            cycles: int, path: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"type": "prompt", "draft_path": path, "pass": pass_name, "set": 0, "index": 0,
            "prompt_id": qid, "source": category, "new_tokens": tokens, "cycles": cycles,
            "accepted_total": tokens - cycles, "cycle_seconds": seconds * 0.9,
            "prefill_seconds": seconds * 0.1, "seconds": seconds, "stopped": True,
            "equal_reference": None if path is None else True}  # fmt: skip


def test_the_table_states_spec_bench_metrics_beside_ours() -> None:
    """Spec-Bench's speed-up is mean tok/s over mean AR tok/s (not the mean of ratios), its
    mean accepted tokens count the bonus token (AR: 1.00); mt_bench pools MT-bench's."""
    manifest = {"data": {"prompts": "spec_bench"}, "settings": {},
                "drafts": [{"path": "d", "name": "btree", "window": 4}]}  # fmt: skip
    records = [
        _record("ar", "1", "writing", 100, 1.0, 100), _record("ar", "2", "math", 100, 4.0, 100),
        _record("ar", "3", "qa", 50, 1.0, 50),
        _record("speculative", "1", "writing", 100, 0.5, 25, "d"),
        _record("speculative", "2", "math", 100, 1.0, 50, "d"),
        _record("speculative", "3", "qa", 50, 1.0, 50, "d"),
    ]  # fmt: skip
    rows = {(r["name"], r["task"]): r for r in spec_bench_report(manifest, records)}
    assert [t for n, t in rows if n == "btree"] == ["writing", "math", "qa", "mt_bench", "overall"]
    assert rows[("AR (target)", "overall")]["mu_acc"] == 1.0
    mt = rows[("btree", "mt_bench")]
    assert mt["mu_acc"] == pytest.approx(200 / 75) and mt["questions"] == 2
    # per question: 200 and 100 tok/s (speculative), 100 and 25 (AR)
    assert mt["sb_tok_s"] == pytest.approx(150.0)
    assert mt["sb_speedup"] == pytest.approx(150.0 / 62.5)  # the mean of ratios would be 3.0
    assert mt["exact"] == "2/2"
    overall = rows[("btree", "overall")]
    assert overall["sb_speedup"] == pytest.approx((350 / 3) / (175 / 3))
    assert spec_bench_report({**manifest, "data": {"source": "synthetic"}}, records) == []


def test_the_main_title_counts_the_questions_decoded_per_run() -> None:
    manifest = {"data": {"prompts": "spec_bench", "questions": 5},
                "settings": {"num_prompt_sets": 2, "num_prompts": None, "max_new_tokens": 16}}  # fmt: skip
    title = title_of(manifest, [{"name": "AR (target)", "prompts": 8}])
    assert "2 set(s) x 4 of 5 Spec-Bench questions (every turn) x 16 bytes" in title


# ---------------------------------------------------------------------- end to end ----
def test_two_turn_questions_end_to_end(
    tmp_path: Path, drafts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The second turn's prompt is the conversation with the model's own first answer; greedy
    speculative == AR per turn; per-category rows; a re-run resumes; a changed file is
    another evaluation."""
    import mtpc.evaluation.run as run

    path = write_questions(tmp_path / "question.jsonl")
    cfg = spec_cfg(tmp_path, path, draft=[str(drafts["btree"])], baseline=str(drafts["ff"]))
    calls: list[tuple[list[int], list[int], str | None]] = []
    real = run.generate

    def spy(model: Any, ids: list[list[int]], **kwargs: Any) -> Any:
        res = real(model, ids, **kwargs)
        for prompt, one in zip(ids, res, strict=True):  # one prompt per call at batch_size=1
            calls.append((list(prompt), list(one.tokens), kwargs.get("method")))
        return res

    with mock.patch.object(run, "generate", spy):
        res = evaluate(cfg)
    codec = get_codec("tiny")
    # per pass (AR, btree, ff): one warm-up, then 3 two-turn + 2 one-turn questions: 8 turns
    assert len(calls) == 3 * (1 + 8)
    ar_calls = calls[1:9]
    first, second = ar_calls[0], ar_calls[1]
    stop = next((i for i, t in enumerate(first[1]) if t in codec.stop_ids), len(first[1]))
    answer = codec.decode(first[1][:stop])  # the answer up to its first stop id
    assert second[0] == codec.generation_prompt([
        {"role": "user", "content": QUESTIONS[0]["turns"][0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": QUESTIONS[0]["turns"][1]},
    ])  # fmt: skip
    assert first[0] == second[0][: len(first[0])] and len(answer) > 0
    answer_ids = codec.encode(answer)
    assert any(second[0][i : i + len(answer_ids)] == answer_ids for i in range(len(second[0])))
    spec_calls = calls[10:18]
    assert [c[0] for c in spec_calls] == [c[0] for c in ar_calls]  # same second-turn prompts

    records = [r for r in read_records(Path(res["folder"])) if r["type"] == "prompt"]
    spec = [r for r in records if r["pass"] == "speculative"]
    two = [r for r in spec if "turns" in r]
    assert len(two) == 2 * 3 and all(len(r["turns"]) == 2 for r in two)
    assert all(t["equal_reference"] is True for r in two for t in r["turns"])
    assert all(r["equal_reference"] is True for r in spec)
    for r in two:  # pooled record: the turns' sums
        assert r["new_tokens"] == sum(t["new_tokens"] for t in r["turns"])
        assert r["cycles"] == len(r["accepted"]) == sum(t["cycles"] for t in r["turns"])
        assert r["turns"][1]["prompt_tokens"] > r["turns"][0]["prompt_tokens"]

    table = {(r["name"], r["task"]): r for r in res["spec_bench"]}
    for name in ("AR (target)", "btree", "ff"):
        for task in ("writing", "math", "translation", "qa", "mt_bench", "overall"):
            assert (name, task) in table, (name, task)
    assert (
        table[("btree", "writing")]["turns"] == 4 and table[("btree", "overall")]["exact"] == "8/8"
    )
    assert table[("AR (target)", "overall")]["mu_acc"] == 1.0
    assert table[("btree", "overall")]["sb_speedup"] > 0
    printed = capsys.readouterr().out
    assert "x AR (SB)" in printed and "mean accepted (SB)" in printed and "mt_bench" in printed
    assert Path(res["files"]["spec_bench_md"]).read_text().startswith("Spec-Bench question.jsonl")
    assert Path(res["files"]["spec_bench_csv"]).is_file()
    assert res["spec_bench_table"].endswith("\n" + SPEC_BENCH_NOTE)

    calls.clear()
    with mock.patch.object(run, "generate", spy):
        evaluate(cfg)  # the same evaluation: resumed, nothing decoded
    assert calls == []
    write_questions(path, QUESTIONS[:4])  # the same path, other content: another evaluation
    with pytest.raises(RecordsError, match=r"data\.sha256"):
        evaluate(cfg)


def test_sampling_runs_draw_other_samples_per_run(tmp_path: Path, drafts: dict[str, Path]) -> None:
    path = write_questions(tmp_path / "q.jsonl", QUESTIONS[3:])
    cfg = spec_cfg(tmp_path, path, draft=str(drafts["ff"]), greedy=False, num_prompt_sets=2)
    res = evaluate(cfg)
    records = [r for r in read_records(Path(res["folder"])) if r["type"] == "prompt"]
    assert sorted(r["seed"] for r in records if r["pass"] == "ar") == [0, 1, 2, 3]


# ------------------------------------------------------------------- command line ----
def _eval_cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, str(REPO / "eval.py"), *args, f"hydra.run.dir={tmp_path / 'h'}"]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)


@pytest.mark.slow
def test_command_line_bad_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["Hi"]}\n{"question_id": 2}\n')
    bad = _eval_cli(["prompts=spec_bench", f"prompts.path={path}"], tmp_path)
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert len(lines) == 1 and f"{path}:2: no 'category' field" in lines[0]
    unknown = _eval_cli(
        ["prompts=spec_bench", f"prompts.path={path.with_name('none.jsonl')}"], tmp_path
    )
    assert unknown.returncode == 2 and "none.jsonl does not exist" in unknown.stderr


@pytest.mark.slow
def test_embedded_default_trained_draft_on_spec_bench_from_the_command_line(
    tmp_path: Path,
) -> None:
    """``python train.py`` (a short run on the tiny target), then ``python eval.py
    prompts=spec_bench prompts.path=...``: per-category rows, every turn equal to AR."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "MTPC_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop("HYDRA_FULL_ERROR", None)
    train = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "circuit=btree", "circuit.window=4",
         "circuit.rank=4", "trainer.max_steps=20", "data.num_rows=300", "data.seq_len=96",
         "trainer.enable_progress_bar=false", "trainer.limit_val_batches=2", "logger=none",
         f"hydra.run.dir={tmp_path / 'h'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    path = write_questions(tmp_path / "question.jsonl")
    out = tmp_path / "eval"
    run = _eval_cli(
        ["prompts=spec_bench", f"prompts.path={path}", "max_new_tokens=48", "plots=false",
         "max_throughput=false", f"output_dir={out}", "progress=false"],
        tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "x AR (SB)" in run.stdout
    results = json.loads((out / "results.json").read_text())
    rows = {(r["name"], r["task"]) for r in results["spec_bench"]}
    assert {t for _, t in rows} == {"writing", "math", "translation", "qa", "mt_bench", "overall"}
    draft = next(r for r in results["spec_bench"] if r["task"] == "overall" and r["pass"] != "ar")
    assert draft["exact"] == "8/8" and draft["mu_acc"] > 1.0
