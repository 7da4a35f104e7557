"""Statistics of the evaluator (issue 34): paired bootstrap intervals against the baseline
draft, drafts merged over training seeds, interleaved timing and its exact resume.

Quick tests work on records written here (hand-computable) or decode a few prompts of
untrained drafts; the slow test decodes the bundled tiny target with a draft, an identical
copy of it and a degraded one (a smaller window).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mtpc.evaluation import run as run_module
from mtpc.evaluation.records import read_records
from mtpc.evaluation.report import report_folders, resolve_checks, title_of
from mtpc.evaluation.run import EvalConfigError, evaluate, interleaved_order
from mtpc.evaluation.statistics import (
    PAIRED_NOTE,
    SEED_NOTE,
    compare,
    configuration,
    paired_bootstrap,
    training_config,
)
from mtpc.export import model_card
from tests.helpers import eval_cfg, make_drafts

UNTIMED = ("name", "mu_acc", "mu_acc_drafts", "acceptance", "prompts", "exact")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_drafts(tmp_path_factory.mktemp("drafts"))


# ------------------------------------------------------------------ records by hand ----
def prompt(path: str | None, pass_name: str, k: int, i: int, tokens: int, cycles: int,
           seconds: float) -> dict[str, Any]:  # fmt: skip
    """A prompt record with the fields the reports read."""
    return {
        "type": "prompt", "draft": "x", "draft_path": path, "pass": pass_name, "set": k,
        "index": i, "prompt_id": f"p{k}-{i}", "source": "synthetic/code", "seed": i,
        "tokens_sha1": f"{path}-{k}-{i}", "equal_reference": None, "new_tokens": tokens,
        "cycles": cycles, "accepted_total": tokens - cycles, "cycle_seconds": seconds,
        "prefill_seconds": 0.0, "seconds": seconds, "stopped": False,
    }  # fmt: skip


def entry(path: str, kind: str = "btree", rank: int = 8, baseline: bool = False) -> dict[str, Any]:
    return {"path": path, "name": Path(path).name, "kind": kind, "window": 4, "rank": rank,
            "lora_layers": 0, "baseline": baseline, "fingerprint": "f", "draft_mode": "map"}  # fmt: skip


def write_folder(
    folder: Path,
    drafts: Sequence[dict[str, Any]],
    records: Sequence[dict[str, Any]],
    training: dict[str, Any] | None = None,
) -> Path:
    """An evaluation folder (manifest.json + records.jsonl) as ``evaluate`` writes one."""
    folder.mkdir(parents=True)
    manifest = {
        "format": 1, "device_name": "cpu", "sessions": [], "target": {"name": "tiny"},
        "data": {"source": "synthetic"}, "drafts": list(drafts),
        "settings": {"greedy": True, "policy": "condition", "num_prompt_sets": 2,
                     "num_prompts": 3, "max_new_tokens": 64, "device": "cpu"},
    }  # fmt: skip
    if training is not None:
        manifest["training"] = training
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def pooled(records: Sequence[dict[str, Any]], num: str, den: str) -> float:
    """The table's statistic by hand: per set Σ num / Σ den, mean over sets."""
    sets = sorted({r["set"] for r in records})
    return statistics.mean(
        sum(r[num] for r in records if r["set"] == k)
        / sum(r[den] for r in records if r["set"] == k)
        for k in sets
    )


# ----------------------------------------------------------------- paired intervals ----
def test_a_draft_against_itself_gives_exactly_zero() -> None:
    a = [prompt("d", "speculative", k, i, 10 + 7 * i, 5 + i, 0.01 * (i + 1)) for k in (0, 1)
         for i in range(6)]  # fmt: skip
    out = compare(a, [dict(r) for r in a], a)
    assert (out["delta_mu_acc"], out["delta_mu_acc_low"], out["delta_mu_acc_high"]) == (0, 0, 0)
    assert out["ratio_tok_s_low"] == out["ratio_tok_s_high"] == pytest.approx(1.0)
    assert out["prompts"] == 12


def test_the_interval_is_paired_by_prompt_and_lies_below_zero_for_a_degraded_draft() -> None:
    """Prompts differ widely (1 to 6 tokens per cycle) but the degraded draft loses 0.5 tokens
    per cycle on every prompt: paired, every resample gives -0.5; an unpaired bootstrap
    (independent draws for the two drafts) would give an interval about 3 wide."""
    good = [prompt("g", "speculative", k, i, 10 * (1 + (5 * i + k) % 6), 10, 0.1) for k in (0, 1)
            for i in range(20)]  # fmt: skip
    worse = [{**r, "draft_path": "w", "new_tokens": r["new_tokens"] - 5} for r in good]
    out = compare(worse, good)
    assert out["delta_mu_acc"] == pytest.approx(-0.5)
    assert out["delta_mu_acc_low"] == pytest.approx(-0.5)
    assert out["delta_mu_acc_high"] == pytest.approx(-0.5)
    noisy = [  # the same loss with noise: an interval below 0
        {**r, "new_tokens": r["new_tokens"] - 5 + random.Random(r["index"]).randint(-4, 4)}
        for r in worse
    ]
    out = compare(noisy, good)
    assert out["delta_mu_acc_low"] < out["delta_mu_acc"] < out["delta_mu_acc_high"] < 0
    assert out["delta_mu_acc"] == pytest.approx(
        pooled(noisy, "new_tokens", "cycles") - pooled(good, "new_tokens", "cycles")
    )


def test_the_bootstrap_is_deterministic_and_uses_its_seed() -> None:
    rng = np.random.default_rng(1)
    pairs = {k: tuple(rng.integers(1, 50, 30).astype(float) for _ in range(4)) for k in (0, 1)}
    first = paired_bootstrap(pairs, np.subtract)
    again = paired_bootstrap(
        {k: tuple(np.copy(a) for a in v) for k, v in pairs.items()}, np.subtract
    )
    assert first == again
    other = paired_bootstrap(pairs, np.subtract, seed=1)
    assert other[0] == first[0] and other[1:] != first[1:]  # same estimate, other draws


def test_the_interval_covers_the_truth_about_95_percent_of_the_time() -> None:
    """200 simulated comparisons (per-prompt tokens per cycle of the reference drawn from
    [1, 6], the draft's 0.3 lower plus noise): the 95 % interval holds the true -0.3 in
    close to 95 % of them."""
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(200):
        cycles = rng.integers(5, 40, 30).astype(float)
        base = rng.uniform(1, 6, 30)
        draft = base - 0.3 + rng.normal(0, 0.5, 30)
        pairs = {0: (draft * cycles, cycles, base * cycles, cycles)}
        _, low, high = paired_bootstrap(pairs, np.subtract, resamples=1000)
        hits += low <= -0.3 <= high
    assert 0.88 <= hits / 200 <= 0.99


def test_paired_table_from_records_matches_the_main_table(tmp_path: Path) -> None:
    """The paired statistics equal the main table's differences and ``x baseline``, pairs
    only prompts both decoded, and report= rebuilds them identically; the printed table and
    results.json hold them."""
    rnd = random.Random(3)
    records = []
    for k in (0, 1):
        for i in range(3):
            records.append(prompt(None, "ar", k, i, 40, 40, 0.4 + 0.01 * i))
            records.append(prompt("/d/btree", "speculative", k, i, 40, rnd.randint(8, 14), 0.2))
            records.append(prompt("/d/ff", "speculative", k, i, 40, rnd.randint(10, 20), 0.25))
    records.append(prompt("/d/cp", "speculative", 0, 0, 40, 10, 0.1))  # one prompt only
    folder = write_folder(
        tmp_path / "f",
        [entry("/d/btree"), entry("/d/cp", "cp"), entry("/d/ff", "ff", 1, baseline=True)],
        records,
    )
    res = report_folders([folder], folder, plots=False, echo=False)
    rows = {r["name"]: r for r in res["rows"]}
    paired = {p["name"]: p for p in res["paired"]}
    assert set(paired) == {"btree", "cp"} and paired["btree"]["vs"] == "ff"
    bt = paired["btree"]
    assert bt["delta_mu_acc"] == pytest.approx(rows["btree"]["mu_acc"] - rows["ff"]["mu_acc"])
    assert bt["ratio_tok_s"] == pytest.approx(rows["btree"]["speedup_baseline"])
    assert bt["speedup_ar"] == pytest.approx(rows["btree"]["speedup_ar"])
    assert bt["delta_mu_acc_low"] < bt["delta_mu_acc"] < bt["delta_mu_acc_high"]
    assert paired["cp"]["prompts"] == 1 and bt["prompts"] == 6
    assert "paired vs ff" in res["paired_table"] and "[95% CI]" in res["paired_table"]
    saved = json.loads(Path(res["files"]["json"]).read_text())
    assert saved["paired"][0]["delta_mu_acc_low"] == pytest.approx(bt["delta_mu_acc_low"])
    assert Path(res["files"]["paired_csv"]).is_file()
    again = report_folders([folder], tmp_path / "again", plots=False, echo=False)
    assert again["paired"] == res["paired"] and again["paired_table"] == res["paired_table"]


def test_without_a_baseline_the_first_draft_is_the_reference(tmp_path: Path) -> None:
    records = [prompt(p, "speculative", 0, i, 30, c + i, 0.1) for i in range(4)
               for p, c in (("/d/a", 10), ("/d/b", 12))]  # fmt: skip
    folder = write_folder(tmp_path / "f", [entry("/d/a"), entry("/d/b")], records)
    res = report_folders([folder], folder, plots=False, echo=False)
    assert [(p["name"], p["vs"]) for p in res["paired"]] == [("b", "a")]
    assert res["paired"][0]["delta_mu_acc_high"] < 0


def test_the_paired_table_states_its_statistics_and_the_title_an_interleaved_run(
    tmp_path: Path,
) -> None:
    records = [prompt(p, "speculative", 0, i, 30, c, 0.1) for i in range(2)
               for p, c in (("/d/a", 10), ("/d/b", 12))]  # fmt: skip
    folder = write_folder(tmp_path / "f", [entry("/d/a"), entry("/d/b")], records)
    res = report_folders([folder], folder, plots=False, echo=False)
    assert res["paired_table"].endswith("\n" + PAIRED_NOTE)
    assert "interleaved" not in res["table"]
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["settings"]["interleave"] = True
    assert " | interleaved | " in title_of(manifest)


# -------------------------------------------------------------------------- seeds ----
def train_cfg(seed: int, rank: int = 8, source: str = "synthetic") -> dict[str, Any]:
    """A training config as a draft's model card records it (``python train.py``)."""
    return {
        "seed": seed, "run_name": f"btree-s{seed}", "stage": "heads", "init_from": None,
        "circuit": {"kind": "btree", "window": 4, "rank": rank},
        "data": {"source": source, "seed": "${oc.select:seed,0}", "num_workers": seed},
        "trainer": {"max_steps": 300, "devices": 1 + seed, "log_every_n_steps": seed + 5},
        "optimizer": {"lr": 0.003}, "paths": {"output_dir": f"/runs/{seed}"},
    }  # fmt: skip


def test_seed_merging_matches_a_hand_computation(tmp_path: Path) -> None:
    """Three folders, one per training seed (btree and its ff baseline; folder 0 also a
    btree of another rank, folders 0 and 1 a btree on other data): mean ± sample std over
    seeds of each draft's table value and of its paired difference, by hand. Fields that do
    not shape the draft (run name, workers, devices) may differ; folder 2 has no training
    in its manifest (an older evaluation) and is read from the drafts' model cards."""
    rnd = random.Random(11)
    folders, hand = [], {"btree": [], "ff": [], "delta": [], "code": []}
    for seed in (0, 1, 2):
        paths = {
            n: str(tmp_path / "drafts" / f"{n}-s{seed}") for n in ("btree", "ff", "r16", "code")
        }
        trainings = {
            paths["btree"]: train_cfg(seed), paths["ff"]: {**train_cfg(seed), "circuit": {
                "kind": "ff", "window": 4, "rank": 1}},
            paths["r16"]: train_cfg(seed, rank=16), paths["code"]: train_cfg(seed, source="code"),
        }  # fmt: skip
        names = ["btree", "ff"] + (["r16"] if seed == 0 else []) + (["code"] if seed < 2 else [])
        records = []
        for k in (0, 1):
            for i in range(3):
                records.append(prompt(None, "ar", k, i, 50, 50, 0.5))
                for n in names:
                    records.append(prompt(paths[n], "speculative", k, i, 50, rnd.randint(10, 30),
                                          rnd.uniform(0.1, 0.3)))  # fmt: skip
        entries = [entry(paths[n], "ff" if n == "ff" else "btree", 1 if n == "ff" else 8,
                         baseline=n == "ff") for n in names]  # fmt: skip
        for n in ("btree", "ff", "code"):
            own = [r for r in records if r["draft_path"] == paths[n]]
            if own:
                hand[n].append(pooled(own, "new_tokens", "cycles"))
        hand["delta"].append(hand["btree"][-1] - hand["ff"][-1])
        if seed == 2:  # the model cards of the drafts, no training in the manifest
            for n in names:
                Path(paths[n]).mkdir(parents=True)
                config = {"circuit": {"kind": "btree", "window": 4, "rank": 8, "vocab_size": 320,
                                      "hidden_size": 32}, "head_init": "pretrained",
                          "lora": {"layers": 0, "rank": 16, "alpha": 32, "dropout": 0.0,
                                   "target_modules": ["q_proj"]},
                          "target": {"model": "tiny"}, "codec": "tiny"}  # fmt: skip
                card = model_card(config, trainings[paths[n]], {"val/loss": 1.0})
                (Path(paths[n]) / "README.md").write_text(card)
        training = None if seed == 2 else {paths[n]: trainings[paths[n]] for n in names}
        folders.append(write_folder(tmp_path / f"eval-s{seed}", entries, records, training))

    res = report_folders(folders, tmp_path / "merged", plots=False, echo=False)
    seeds = {s["name"]: s for s in res["seeds"]}
    btree = seeds["btree n=4 r=8 k=0 [data.source=synthetic]"]
    code = seeds["btree n=4 r=8 k=0 [data.source=code]"]
    ff = seeds["ff n=4 r=1 k=0"]
    assert len(seeds) == 3  # the rank-16 draft has one seed: not merged
    assert btree["seeds"] == "0,1,2" and code["seeds"] == "0,1" and btree["drafts"] == 3
    assert btree["mu_acc"] == pytest.approx(statistics.mean(hand["btree"]))
    assert btree["mu_acc_std"] == pytest.approx(statistics.stdev(hand["btree"]))
    assert ff["mu_acc"] == pytest.approx(statistics.mean(hand["ff"]))
    assert ff["mu_acc_std"] == pytest.approx(statistics.stdev(hand["ff"]))
    assert code["mu_acc"] == pytest.approx(statistics.mean(hand["code"]))
    # each seed's btree against its own folder's ff baseline, then over seeds
    assert btree["vs"] == "ff n=4 r=1 k=0"
    assert btree["delta_mu_acc"] == pytest.approx(statistics.mean(hand["delta"]))
    assert btree["delta_mu_acc_std"] == pytest.approx(statistics.stdev(hand["delta"]))
    assert "over seeds (3 configurations)" in res["seeds_table"]
    assert res["seeds_table"].endswith("\n" + SEED_NOTE)
    assert Path(res["files"]["seeds_csv"]).is_file()


def test_the_configuration_ignores_only_the_seed_and_what_does_not_shape_the_draft(
    tmp_path: Path,
) -> None:
    assert configuration(train_cfg(0)) == configuration(train_cfg(5))
    assert configuration(train_cfg(0)) != configuration(train_cfg(0, rank=16))
    changed = {**train_cfg(1), "trainer": {**train_cfg(1)["trainer"], "max_steps": 600}}
    assert configuration(changed) != configuration(train_cfg(0))  # the budget shapes it
    assert configuration({"circuit": {"kind": "ff"}}) is None  # no seed recorded: not merged
    # a LoRA stage started from a heads draft: compared through that draft's configuration
    heads = {str(tmp_path / f"h{s}"): train_cfg(s) for s in (0, 1)}
    lora = [{**train_cfg(s), "stage": "lora", "init_from": str(tmp_path / f"h{s}")} for s in (0, 1)]
    assert configuration(lora[0], heads) == configuration(lora[1], heads)
    assert configuration(lora[0]) != configuration(lora[1])  # unreadable: the paths differ
    assert training_config(tmp_path / "nowhere") is None


# ---------------------------------------------------------------------- interleave ----
def test_interleaved_order_alternates() -> None:
    assert interleaved_order(["ar", "a", "b"], 0) == ["ar", "a", "b"]
    assert interleaved_order(["ar", "a", "b"], 1) == ["b", "a", "ar"]
    assert interleaved_order(["ar", "a", "b"], 4) == ["ar", "a", "b"]


def lanes_of(records: Sequence[dict[str, Any]]) -> list[list[tuple[Any, str]]]:
    """Per prompt (in order), the (draft path, pass) of its records in file order."""
    out: dict[tuple[int, int], list[tuple[Any, str]]] = {}
    for r in records:
        if r["type"] == "prompt":
            out.setdefault((r["set"], r["index"]), []).append((r["draft_path"], r["pass"]))
    return [out[k] for k in sorted(out)]


def test_interleaved_timing_runs_prompt_by_prompt_in_alternating_order(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    over = {"draft": [str(drafts["btree"])], "baseline": str(drafts["ff"]), "plots": False}
    plain = evaluate(eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "plain")))
    inter = evaluate(eval_cfg(tmp_path, **over, interleave=True, output_dir=None))
    folder = Path(inter["folder"])
    assert folder != tmp_path / "plain" and inter["settings"]["interleave"] is True
    records = read_records(folder)
    bt, ff = str(drafts["btree"]), str(drafts["ff"])
    forward = [(None, "ar"), (bt, "speculative"), (bt, "max_throughput"), (ff, "speculative"),
               (ff, "max_throughput")]  # fmt: skip
    order = lanes_of(records)  # the order they were decoded in (appended at once)
    assert order == [forward, forward[::-1]] * 2
    assert [r["slot"] for r in records if r["type"] == "prompt"][:10] == [0, 1, 2, 3, 4] * 2
    pending = [r for r in records if r.get("check_pending")]  # drafts before AR: odd prompts
    assert {(r["draft_path"], r["index"]) for r in pending} == {(bt, 1), (ff, 1)}
    assert all(r["equal_reference"] is None for r in pending)

    def untimed(res: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: r.get(k) for k in UNTIMED} for r in res["rows"]]

    assert json.dumps(untimed(inter)) == json.dumps(untimed(plain))  # exact "= AR" included
    assert inter["rows"][1]["exact"] == "4/4"
    # the paired table of the folder is the same whatever decoded it, and report= rebuilds it
    again = evaluate(eval_cfg(tmp_path, report=str(folder), plots=False))
    assert again["paired"] == inter["paired"]


def test_resume_after_an_interruption_mid_interleave_decodes_nothing_twice(
    tmp_path: Path, drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    over = {"draft": [str(drafts["btree"])], "baseline": str(drafts["ff"]), "plots": False,
            "interleave": True, "output_dir": str(tmp_path / "out")}  # fmt: skip
    decoded: list[tuple[Any, str, int, int]] = []
    original = run_module.Lane.decode

    def decode(self: Any, items: Any, references: Any) -> list[dict[str, Any]]:
        ((k, i, _),) = items  # batch_size=1: one prompt per call
        if len(decoded) == 7:  # prompt 0's five lanes, then two of prompt 1 (reversed)
            raise KeyboardInterrupt
        decoded.append((self.path, self.pass_name, k, i))
        return original(self, items, references)

    monkeypatch.setattr(run_module.Lane, "decode", decode)
    with pytest.raises(KeyboardInterrupt):
        evaluate(eval_cfg(tmp_path, **over))
    before = [r for r in read_records(tmp_path / "out") if r["type"] == "prompt"]
    assert len(before) == 7 and before[-1]["check_pending"]  # ff's greedy check awaits AR
    first = list(decoded)
    decoded.clear()
    monkeypatch.setattr(
        run_module.Lane, "decode", lambda *a: (decoded.append(a[1][0][:2]), original(*a))[1]
    )
    resumed = evaluate(eval_cfg(tmp_path, **over))
    after = [r for r in read_records(tmp_path / "out") if r["type"] == "prompt"]
    keys = [(r["draft_path"], r["pass"], r["set"], r["index"]) for r in after]
    assert len(after) == 20 == len(set(keys)) and after[:7] == before
    assert len(decoded) == 13 and not {tuple(k) for k in first} & {
        (r["draft_path"], r["pass"], r["set"], r["index"]) for r in after[7:]
    }
    assert [r["exact"] for r in resumed["rows"][1:]] == ["4/4", "4/4"]
    assert lanes_of(after)[1][:2] == [(str(drafts["ff"]), "max_throughput"),
                                      (str(drafts["ff"]), "speculative")]  # fmt: skip


def test_resolve_checks_compares_with_ar_after_the_fact() -> None:
    ar = {**prompt(None, "ar", 0, 0, 5, 5, 0.1), "tokens_sha1": "h"}
    same = {
        **prompt("d", "speculative", 0, 0, 5, 2, 0.1),
        "tokens_sha1": "h",
        "check_pending": True,
    }
    other = {**same, "draft_path": "e", "tokens_sha1": "z"}
    lone = {**same, "index": 1}
    out = resolve_checks([ar, same, other, lone])
    assert [r["equal_reference"] for r in out[1:]] == [True, False, None]


def test_interleave_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(EvalConfigError, match=r"interleave='yes' is not allowed; allowed: True"):
        evaluate(eval_cfg(tmp_path, interleave="yes", draft="/nonexistent"))


# --------------------------------------------------------------------- end to end ----
@pytest.mark.slow
def test_a_copy_gives_zero_and_a_smaller_window_an_interval_below_zero(tmp_path: Path) -> None:
    """The bundled tiny target with an FF draft n = 8 (its MTP heads, untrained: it accepts
    about 3.5 tokens per cycle), a byte-identical copy of it and a degraded draft (n = 2),
    interleaved, greedy: the copy's difference is exactly 0 with the interval [0, 0], the
    smaller window's interval lies below 0."""
    from mtpc.model import MTPCModel

    good = MTPCModel.from_config("tiny", kind="ff", window=8, rank=1).save_pretrained(
        tmp_path / "good" / "draft"
    )
    small = MTPCModel.from_config("tiny", kind="ff", window=2, rank=1).save_pretrained(
        tmp_path / "small" / "draft"
    )
    shutil.copytree(tmp_path / "good", tmp_path / "copy")
    cfg = eval_cfg(
        tmp_path, draft=[str(small), str(tmp_path / "copy" / "draft")], baseline=str(good),
        num_prompts=6, num_prompt_sets=2, max_new_tokens=48, max_throughput=False,
        plots=False, interleave=True, suppress_eos=False,
    )  # fmt: skip
    cfg["data"]["seq_len"] = 512
    res = evaluate(cfg)
    paired = {p["name"]: p for p in res["paired"]}
    copy, degraded = paired["copy"], paired["small"]
    assert copy["vs"] == degraded["vs"] == "good" and copy["prompts"] == 12
    assert (copy["delta_mu_acc"], copy["delta_mu_acc_low"], copy["delta_mu_acc_high"]) == (0, 0, 0)
    assert degraded["delta_mu_acc_high"] < 0
    assert "paired vs good" in res["paired_table"]


@pytest.mark.slow
def test_a_killed_interleaved_evaluation_resumes_to_the_uninterrupted_table(
    tmp_path: Path, drafts: dict[str, Path]
) -> None:
    """SIGKILL of a subprocess mid-interleave (and a torn last line): the rerun decodes only
    the missing records, and the untimed table equals an uninterrupted interleaved run's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    over = {"draft": [str(drafts["btree"])], "baseline": str(drafts["ff"]), "plots": False,
            "interleave": True, "num_prompts": 4}  # fmt: skip
    killed = eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "killed"))
    (tmp_path / "cfg.json").write_text(json.dumps(killed))
    code = "import json,sys; from mtpc.evaluation.run import evaluate; evaluate(json.load(open(sys.argv[1])))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "cfg.json")], cwd=root, env=env
    )
    records = tmp_path / "killed" / "records.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if records.is_file() and records.read_text().count('"type":"prompt"') >= 13:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait() == -signal.SIGKILL, "the evaluation ended before it could be killed"
    before = [r for r in read_records(tmp_path / "killed") if r["type"] == "prompt"]
    total = 2 * 4 * 5  # 2 sets x 4 prompts x (AR + btree sd/max + ff sd/max)
    assert 13 <= len(before) < total
    with open(records, "ab") as f:
        f.write(b'{"type":"prompt","draft":"btr')
    resumed = evaluate(killed)
    after = [r for r in read_records(tmp_path / "killed") if r["type"] == "prompt"]
    keys = [(r["draft_path"], r["pass"], r["set"], r["index"]) for r in after]
    assert len(after) == total == len(set(keys)) and after[: len(before)] == before
    whole = evaluate(eval_cfg(tmp_path, **over, output_dir=str(tmp_path / "whole")))
    untimed = [[{k: r.get(k) for k in UNTIMED} for r in res["rows"]] for res in (resumed, whole)]
    assert json.dumps(untimed[0]) == json.dumps(untimed[1])
    assert [p["delta_mu_acc"] for p in resumed["paired"]] == [
        p["delta_mu_acc"] for p in whole["paired"]
    ]
