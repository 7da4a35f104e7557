"""Smoke runs of the benchmark and tool scripts (``scripts/bench_*.py``, ``draw_circuit.py``,
``head_bytes.py``): each runs end to end in a subprocess at its smallest settings, so that a
change to ``mtpc/`` that breaks a script (a renamed function, a dropped argument) fails here.

Every case asserts exit code 0 and something only a real run prints (a key of its JSON, a
table header), not the numbers. Offline (hub, datasets, wandb); every file a script writes
(its ``--json``/``--out``, its temporary and data-cache folders) lands under ``tmp_path``.
The scripts that build EvaByte from its real remote code (``bench_cycle_cost.py``,
``bench_packed_documents.py``) need ``MTPC_EVABYTE_CODE=<dir with evabyte_hf/*.py>`` (as
tests/test_evabyte_triton.py), skipped otherwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.helpers import REPO, make_drafts

pytestmark = pytest.mark.slow

CODE = os.environ.get("MTPC_EVABYTE_CODE")
SCRIPTS = REPO / "scripts"
NO_CODE = (
    "set MTPC_EVABYTE_CODE=<dir with evabyte_hf/*.py> (EvaByte's real remote code, "
    "OpenEvaByte/evabyte @ 432331a; never committed) to run this script"
)

# bench_training.py times 9 configurations (STP + 4 families x k in {0, 1}), each in a fresh
# spawned process (~8 s each here), and has no flag to pick families: run its main() with
# FAMILIES cut to BTree (STP and BTree k = 0, 1: 3 processes). The script is not edited.
BENCH_TRAINING_BTREE_ONLY = """
import sys
sys.path.insert(0, "scripts")
sys.argv = ["scripts/bench_training.py", *sys.argv[1:]]
import bench_training
bench_training.FAMILIES = ("btree",)
bench_training.main()
"""


class Case(NamedTuple):
    args: str
    """The interpreter's arguments (a script path first, or ``-c``), split at whitespace;
    ``{tmp}`` is ``tmp_path``, ``{code}`` the evabyte_hf folder, ``{draft}`` a saved draft."""
    check: Callable[[str, Path], None]
    """Asserts on the run's stdout and the files it wrote under ``tmp_path``."""
    evabyte: bool = False
    """Needs EvaByte's remote code (``MTPC_EVABYTE_CODE``)."""


def _json_in(stdout: str) -> dict[str, Any]:
    """The JSON object a script printed (from its first line that opens one)."""
    lines = stdout.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    found, _ = json.JSONDecoder().raw_decode("".join(lines[start:]))
    assert isinstance(found, dict)
    return found


def _load(path: Path) -> Any:
    assert path.is_file(), f"{path} not written"
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------ checks ----
def _head_bytes(out: str, tmp: Path) -> None:
    assert "| target | head | trunk MB | sum proj. MB |" in out
    assert "| EvaByte-SFT (6.5 B) | btree n=16 r=32 |" in out


def _draw_circuit(out: str, tmp: Path) -> None:
    image = tmp / "btree.png"
    assert f"wrote {image} (Structure(kind='btree', window=4, rank=2" in out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_tiny_target(out: str, tmp: Path) -> None:
    report = _json_in(out)
    for key in ("generate_tokens_per_s", "kv_loop_tokens_per_s", "no_cache_tokens_per_s"):
        assert report[key] > 0, key
    assert report["new_tokens"] == 4
    assert "greedy answer:" in out


def _bench_circuits(out: str, tmp: Path) -> None:
    assert "| family | n | r | head ms | sample+prefix ms |" in out
    assert "chunked likelihood memory" in out
    report = _load(tmp / "circuits.json")
    assert {row["kind"] for row in report["rows"]} == {"ff", "cp", "hmm", "btree"}
    assert all(row["train_ms"] > 0 for row in report["rows"])
    assert [m["T"] for m in report["memory"]] == [8]


def _bench_memory(out: str, tmp: Path) -> None:
    assert "| k | head MiB | LoRA params | LoRA MiB | held / target | peak delta MiB |" in out
    assert "\n| 0 | " in out and "\n| 1 | " in out


def _bench_batch(out: str, tmp: Path) -> None:
    assert "| mode | B | AR tok/s | SD tok/s | SD/AR |" in out
    report = _load(tmp / "batch.json")
    assert [(r["mode"], r["batch_size"]) for r in report["decode"]] == [
        ("greedy", 1), ("greedy", 2), ("sampling", 1), ("sampling", 2),
    ]  # fmt: skip
    assert [r["batch_size"] for r in report["regenerate"]] == [1, 2]
    assert all(r["sd_tok_s"] > 0 for r in report["decode"])


def _bench_static_decode(out: str, tmp: Path) -> None:
    assert "| B | eager tok/s | compiled tok/s | x eager | rows differ |" in out
    report = _load(tmp / "static.json")
    assert [r["batch_size"] for r in report["rows"]] == [1, 2]
    assert all(r["differ"] == 0 and r["engines"] == ["compiled"] for r in report["rows"])
    assert all(r["eager_step_dispatched_ops"] > 0 for r in report["rows"])
    assert "| B | tok/cycle | eager tok/s | compiled tok/s |" in out
    assert [r["batch_size"] for r in report["chain"]] == [1, 2]
    assert all(r["differ"] == 0 and r["engines"] == ["compiled"] for r in report["chain"])


def _bench_decoding(out: str, tmp: Path) -> None:
    assert "| draft | mode | mu_lat ms | x FF cycle | mu_acc | tok/s | x AR |" in out
    report = _load(tmp / "decoding.json")
    assert set(report["ar"]) == {"greedy", "sampling"}
    assert len(report["rows"]) == 4 * 2  # 4 families x 2 modes
    assert {r["mode"] for r in report["rows"]} == {"greedy/zmap", "sampling/zsample"}


def _bench_data(out: str, tmp: Path) -> None:
    assert "| run | rows | mean ids/row (kept) | seconds |" in out
    assert "Projected preprocessing of 939,344 Tülu 3 rows" in out
    assert "PackedDataset item (L=512, n=2)" in out


def _bench_hetero(out: str, tmp: Path) -> None:
    table = (tmp / "hetero.md").read_text(encoding="utf-8")
    assert "| mode | algorithm | drafter | lookahead | AR tok/s |" in table
    for algorithm in ("slem", "tli", "union", "slrs", "standard"):
        assert f"| greedy | {algorithm} |" in table and f"| sampling | {algorithm} |" in table


def _bench_draft_scale(out: str, tmp: Path) -> None:
    assert "### EvaByte-SFT (6.5 B): d = 4096" in out
    assert "### byte Llama 3.2 3B (2.82 B): d = 3072" in out
    assert "| head | W + sum proj. MB | greedy zmap | greedy map |" in out
    assert "\n| btree r=32 | " in out


def _bench_eval_records(out: str, tmp: Path) -> None:
    assert "| mode | median s | min s | max s |" in out
    assert "\n| streamed | " in out and "\n| in memory | " in out
    assert "one append (serialise + write + flush):" in out


def _bench_training(out: str, tmp: Path) -> None:
    assert "| draft | r | k | step ms | tokens/s | x STP step time |" in out
    rows = _load(tmp / "training.json")
    assert [(r["kind"], r["lora"]) for r in rows] == [("stp", 0), ("btree", 0), ("btree", 1)]
    assert all(r["step_s"] > 0 for r in rows)


def _number(value: Any, positive: bool = True) -> None:
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    assert math.isfinite(value) and (value > 0 or not positive), value


def _bench_gpu(out: str, tmp: Path) -> None:
    assert "| target | what | wall | GPU busy | note |" in out
    assert "| mode | B | AR tok/s | SD tok/s | SD/AR |" in out
    report = _load(tmp / "gpu.json")
    assert report["errors"] == {}
    _number(report["copy_GBps"])
    for name in ["byte_llama"] + (["evabyte"] if CODE else []):
        decode = report[name]["decode"]
        for key in ("weight_GB", "memory_bound_step_ms", "ar_wall_ms", "ar_cold_wall_ms",
                    "first_visit_penalty"):  # fmt: skip
            _number(decode[key])
        _number(decode["ar_cpu_ms"], positive=False)  # a difference of two profiled runs
        assert decode["ar_gpu_ms"] is None and decode["ar_gpu_busy_share"] is None  # CPU: n/a
        assert set(report[name]["cycle"]) == {"ff", "cp", "btree"}
        for cycle in report[name]["cycle"].values():
            _number(cycle["wall_ms"])
            assert cycle["tokens_per_step"] == 4  # all-accepting, n = 4
        train = report[name]["train"]
        assert [(t["precision"], t["bytes"]) for t in train] == [
            ("32-true", 64),
            ("bf16-mixed", 64),
        ]
        for row in train:
            for key in ("step_s", "bytes_per_s", "loss", "tflop_per_step"):
                _number(row[key])
            assert row["mfu"] is None and row["peak_GB"] is None  # unknown peak; CPU
    if not CODE:
        assert "skipped" in report["evabyte"]
    assert [r["batch_size"] for r in report["batch"]] == [1, 2]
    for row in report["batch"]:
        _number(row["ar_tok_s"])
        _number(row["sd_tok_s"])


def _bench_cycle_cost(out: str, tmp: Path) -> None:
    report = _json_in(out)
    for model in ("evabyte", "byte_llama"):
        for n in (4, 8, 16):
            assert report[f"{model} n={n}"]["cycle_in_ar_steps"] > 0


def _bench_packed_documents(out: str, tmp: Path) -> None:
    report = _json_in(out)
    assert set(report) == {"evabyte", "tiny_control", "padding"}
    assert "feature_rel_diff_max" in report["evabyte"][0]
    assert [p["seq_len"] for p in report["padding"]] == [2048, 8192]


# ------------------------------------------------------------------------------- cases ----
CASES: dict[str, Case] = {
    "head_bytes.py": Case("scripts/head_bytes.py", _head_bytes),
    "draw_circuit.py": Case(
        "scripts/draw_circuit.py --kind btree --window 4 --rank 2 --backend matplotlib"
        " --out {tmp}/btree.png",
        _draw_circuit,
    ),
    "bench_tiny_target.py": Case(
        "scripts/bench_tiny_target.py --new-tokens 4 --repeats 1 --no-cache-tokens 4",
        _bench_tiny_target,
    ),
    "bench_circuits.py": Case(
        "scripts/bench_circuits.py --windows 2 --ranks 2 --vocab 8 --hidden 8 --train-batch 2"
        " --mem-T 8 --mem-config btree,2,2 --mem-hidden 8 --mem-chunk 4"
        " --json {tmp}/circuits.json",
        _bench_circuits,
    ),
    "bench_memory.py": Case(
        "scripts/bench_memory.py --ks 0,1 --window 2 --rank 2 --lora-rank 2", _bench_memory
    ),
    "bench_batch.py": Case(
        "scripts/bench_batch.py --what decode regenerate --window 2 --rank 2 --prompts 2"
        " --max-new-tokens 4 --sizes 1 2 --sampling --json {tmp}/batch.json",
        _bench_batch,
    ),
    "bench_static_decode.py": Case(
        "scripts/bench_static_decode.py --backend eager --sizes 1 2 --prompts 2"
        " --max-new-tokens 4 --steps 2 --repeats 1 --chain --window 2 --rank 2"
        " --json {tmp}/static.json",
        _bench_static_decode,
    ),
    "bench_decoding.py": Case(
        "scripts/bench_decoding.py --window 2 --rank 2 --prompts 1 --new 4"
        " --modes greedy/zmap sampling/zsample --out {tmp}/decoding.json",
        _bench_decoding,
    ),
    "bench_data.py": Case(
        # --mean-bytes stays at its default: below 1,634 B no log-normal fits (refused, below)
        "scripts/bench_data.py --num-rows 50 --long-rows 20 --seq-len 512 --window 2"
        " --pack-docs 100",
        _bench_data,
    ),
    "bench_hetero.py": Case(
        "scripts/bench_hetero.py --prompts 1 --new 4 --steps 1 --out {tmp}/hetero.md",
        _bench_hetero,
    ),
    "bench_draft_scale.py": Case(
        # the paper's shapes are fixed (d = 4096: ~1.3 GB, ~15 s); n = 2 is the small knob
        "scripts/bench_draft_scale.py --window 2 --repeats 1 --threads 1",
        _bench_draft_scale,
    ),
    "bench_eval_records.py": Case(
        "scripts/bench_eval_records.py {draft} --repeats 1 num_prompts=1 max_new_tokens=4"
        " data.num_rows=300 max_throughput=false warmup=0",
        _bench_eval_records,
    ),
    "bench_training.py": Case(
        "-c {bench_training} --window 2 --rank 2 --seq-len 16 --batch-size 1 --rounds 1"
        " --threads 1 --cache-dir {tmp}/cache --json {tmp}/training.json",
        _bench_training,
    ),
    "bench_gpu.py": Case(
        # the EvaByte target runs when MTPC_EVABYTE_CODE is set (the script's default), and is
        # a SKIPPED line otherwise; the tiny target and the byte Llama always run
        "scripts/bench_gpu.py --device cpu --dtype float32 --layers 2 --hidden 64"
        " --intermediate 128 --heads 4 --kv-heads 2 --window 32 --chunk 4 --n 4 --rank 4"
        " --prompt-len 24 --steps 2 --copy-mib 16 --batch-sizes 1,2 --batch-prompts 2"
        " --batch-new 4 --train-lengths 64 --train-steps 1 --out {tmp}/gpu.json",
        _bench_gpu,
    ),
    "bench_cycle_cost.py": Case(
        "scripts/bench_cycle_cost.py {code} --new 4 --repeats 1", _bench_cycle_cost, evabyte=True
    ),
    "bench_packed_documents.py": Case(
        "scripts/bench_packed_documents.py {code} --rows 20", _bench_packed_documents, evabyte=True
    ),
}


def _argv(args: str, tmp: Path) -> list[str]:
    """``args`` split at whitespace, then its placeholders filled in (paths may hold spaces)."""
    values = {"tmp": str(tmp), "bench_training": BENCH_TRAINING_BTREE_ONLY}
    if "{code}" in args:
        assert CODE
        values["code"] = str(Path(CODE) / "evabyte_hf")  # the scripts take evabyte_hf itself
    if "{draft}" in args:  # an untrained FF draft of a random tiny target, as eval.py loads it
        values["draft"] = str(make_drafts(tmp / "drafts")["ff"])
    return [arg.format(**values) for arg in args.split()]


def test_every_bench_and_tool_script_has_a_case() -> None:
    """A new ``scripts/bench_*.py`` gets its smoke run here."""
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")} | {"draw_circuit.py", "head_bytes.py"}
    assert scripts == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_script_runs(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    if case.evabyte and not CODE:
        pytest.skip(NO_CODE)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TMPDIR": str(tmp_path),  # tempfile.mkdtemp / TemporaryDirectory of the scripts
        "MTPC_CACHE": str(tmp_path / "cache"),  # the data cache of build_datamodule
        "MPLBACKEND": "Agg",
    }
    result = subprocess.run(
        [sys.executable, *_argv(case.args, tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    case.check(result.stdout, tmp_path)


def test_bench_data_refuses_a_mean_no_log_normal_fits() -> None:
    """``--mean-bytes 1000`` with the 8,192-byte limit and Tülu's 3.6 % too-long share has no
    solution: one argparse line naming the flag and the least mean, not a math domain error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "scripts/bench_data.py", "--mean-bytes", "1000"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--mean-bytes" in run.stderr and "at least 1634" in run.stderr
    assert "Traceback" not in run.stderr
