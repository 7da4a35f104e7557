"""The real-code study's cells (configs/experiment/code/) and its script (scripts/run_study.sh).

The study is a CPU miniature of the paper's tables (docs/BENCHMARKS.md): its numbers are only
comparable if every cell shares one recipe, seeds keep their runs apart, stage 2 starts from
the same seed's stage-1 draft, and the script trains and evaluates every cell it ships.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from mtpc.training.settings import validate_train_config

REPO = Path(__file__).resolve().parents[1]
CELLS = sorted(
    p.stem for p in (REPO / "configs" / "experiment" / "code").glob("*.yaml")
    if not p.stem.startswith("_")
)  # fmt: skip
SCRIPT = REPO / "scripts" / "run_study.sh"


@functools.cache
def _composed(name: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=[f"experiment=code/{name}"])


def _cell(name: str, seed: int = 0) -> DictConfig:
    """The cell's training config at ``seed`` (``${seed}`` interpolations follow it)."""
    cfg = _composed(name).copy()
    cfg.seed = seed
    return cfg


def test_the_grid_is_the_issues() -> None:
    """FF r1, CP r8/32, HMM r32, BTree r32 at n = 8 and 16, LoRA k0/1 at n = 16 for FF and
    BTree, and FF/BTree on regenerated answers."""
    grid = {f"{k}_n{n}_r{r}" for n in (8, 16) for k, r in
            (("ff", 1), ("cp", 8), ("cp", 32), ("hmm", 32), ("btree", 32))}  # fmt: skip
    lora = {f"{c}_lora{k}" for c in ("ff_n16_r1", "btree_n16_r32") for k in (0, 1)}
    regen = {f"{c}_regen_{m}" for c in ("ff_n8_r1", "btree_n8_r32") for m in ("greedy", "t1")}
    assert set(CELLS) == grid | lora | regen


@pytest.mark.slow
@pytest.mark.parametrize("name", CELLS)
def test_every_cell_composes_with_the_one_recipe(name: str) -> None:
    cfg = _cell(name)
    validate_train_config(cfg)
    kind, n, r = re.match(r"(\w+?)_n(\d+)_r(\d+)", name).groups()  # type: ignore[union-attr]
    assert (cfg.circuit.kind, cfg.circuit.window, cfg.circuit.rank) == (kind, int(n), int(r))
    assert cfg.model.run_label == "tiny_code" and cfg.model.path.endswith("assets/tiny_code")
    assert (cfg.trainer.max_steps, cfg.data.seq_len, cfg.data.batch_size) == (100, 256, 2)
    assert cfg.data.seed == 0 and cfg.validate_before_training is False
    assert cfg.lora.layers == (1 if name.endswith("lora1") else 0)
    assert cfg.stage == ("lora" if "_lora" in name else "heads")


@pytest.mark.slow
def test_seeds_and_cells_never_share_a_run_folder() -> None:
    names = [_cell(c, s).run_name for c in CELLS for s in (0, 1, 2)]
    assert len(set(names)) == len(names)
    assert _cell("btree_n16_r32", 2).run_name == "code-btree-n16-r32-k0-heads-s2"


@pytest.mark.slow
@pytest.mark.parametrize("name", [c for c in CELLS if "_lora" in c])
def test_stage_two_starts_from_the_same_seeds_stage_one(name: str) -> None:
    cfg = _cell(name, seed=1)
    stage_one = _cell(name.split("_lora")[0], seed=1)
    assert cfg.init_from == f"{cfg.paths.root_dir}/outputs/train/{stage_one.run_name}/draft"


@pytest.mark.slow
def test_the_script_trains_and_evaluates_every_cell() -> None:
    script = SCRIPT.read_text()
    for name in CELLS:
        assert re.search(rf"\b{name}\b", script), f"run_study.sh never trains {name}"
        run = _cell(name).run_name.removeprefix("code-").removesuffix("-s0")
        assert run in script, f"run_study.sh never evaluates {run}"
    for mode in ("greedy", "t1"):  # the regenerated cells read what the script writes
        path = _cell(f"ff_n8_r1_regen_{mode}").data.path
        assert path.endswith(f"outputs/regenerate/code-{mode}-train")
        assert f"$R/code-{mode}" in script or "$R/code-$mode-train" in script


def test_an_unknown_phase_fails_in_one_line_before_any_work() -> None:
    """Even after a valid phase: ``PY=false`` would fail any work that started."""
    env = {"PATH": os.environ["PATH"], "PY": "false"}
    out = subprocess.run(
        ["bash", str(SCRIPT), "report", "trian"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "run_study.sh: unknown phase 'trian'; allowed: train, regenerate, eval, report"
    ]


# ------------------------------------------------------------------ the study's tables ----
def _table_module():
    spec = importlib.util.spec_from_file_location("study_table", REPO / "scripts/study_table.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _folder(path: Path, drafts: dict[str, tuple[str, int]]) -> None:
    """An evaluation folder: AR and ``drafts`` ({name: (kind, cycles per prompt)}), 2 sets x
    6 prompts of 60 tokens, 10 ms per cycle."""
    path.mkdir(parents=True)
    records, rows = [], []
    for name, (kind, cycles) in {"AR": ("ar", 60), **drafts}.items():
        draft_path = None if kind == "ar" else f"/runs/{name}/draft"
        for s in (0, 1):
            for i in range(6):
                c = cycles + (i % 3)  # prompts differ, the same way for every draft
                records.append({"type": "prompt", "draft_path": draft_path, "set": s,
                                "index": i, "pass": "ar" if kind == "ar" else "speculative",
                                "new_tokens": 60, "cycles": c, "cycle_seconds": 0.01 * c})  # fmt: skip
        rows.append({"name": name, "path": draft_path, "kind": kind, "rank": 32,
                     "pass": "ar" if kind == "ar" else "speculative",
                     "mu_acc": 60 / cycles, "mu_acc_std": 0.0, "speedup_ar": 60 / cycles})  # fmt: skip
    (path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (path / "results.json").write_text(json.dumps({"rows": rows}))


def _low_high(cell: str) -> tuple[float, float]:
    """The interval of a ``+0.89 [+0.85, +0.94]`` cell."""
    low, high = cell.split("[")[1].rstrip("]").split(", ")
    return float(low), float(high)


def test_the_tables_compare_each_draft_with_its_own_control(tmp_path: Path) -> None:
    """Δ against FF in the grid and against the same family's control elsewhere: a draft
    that needs fewer cycles than its control gets an interval above 0, a worse one below."""
    table = _table_module()
    for mode in ("greedy", "sampling"):
        _folder(tmp_path / f"n8-s0-{mode}", {"ff": ("ff", 20), "btree": ("btree", 15)})
        _folder(
            tmp_path / f"lora-s0-{mode}",
            {"code-ff-n16-r1-k0-lora-s0": ("ff", 20), "code-ff-n16-r1-k1-lora-s0": ("ff", 30),
             "code-btree-n16-r32-k0-lora-s0": ("btree", 20),
             "code-btree-n16-r32-k1-lora-s0": ("btree", 12)},
        )  # fmt: skip
    grid = table.grid(tmp_path, 8)
    btree = next(line for line in grid if line.startswith("| BTREE") or "BTree" in line)
    assert _low_high(btree.split(" | ")[2])[0] > 0.5  # about 60/15 - 60/20 tokens per cycle
    lora = {line.split(" | ")[0]: line.split(" | ") for line in table.against_own(
        tmp_path, "lora-s0", {"-k1-": "-k0-"})[2:]}  # fmt: skip
    assert _low_high(lora["| code-btree-n16-r32-k1-lora-s0"][2])[0] > 1.5  # about 5 - 3
    assert _low_high(lora["| code-ff-n16-r1-k1-lora-s0"][2])[1] < -0.5  # about 2 - 3
    assert lora["| code-ff-n16-r1-k0-lora-s0"][2] == "-"  # a control has no Δ


# ------------------------------------------ a code draft evaluated on another source ----
def _card(folder: Path, source: str) -> Path:
    """Records ``source`` as the draft folder's training data (its model card's config)."""
    config = {"seed": 0, "data": {"source": source}}
    (folder / "README.md").write_text(f"## Training config\n\n```json\n{json.dumps(config)}\n```\n")
    return folder


def test_a_draft_of_another_data_source_is_named_in_a_warning(tmp_path: Path, caplog) -> None:
    """A code draft evaluated on the default (synthetic) prompts is said, once; the matching
    source, a draft of local files and a draft without a card are not."""
    from mtpc.evaluation.folders import build_manifest, warn_other_data
    from tests.helpers import eval_cfg, make_drafts

    drafts = make_drafts(tmp_path / "drafts")
    code = _card(drafts["btree"], "python_code")
    with caplog.at_level("WARNING", logger="mtpc.evaluation.folders"):
        build_manifest(eval_cfg(tmp_path), [code, drafts["ff"]], [])
    said = [r.getMessage() for r in caplog.records if "was trained on" in r.getMessage()]
    assert len(said) == 1 and str(code) in said[0] and "pass data=python_code" in said[0]
    local = {"seed": 0, "data": {"source": "local"}}
    assert warn_other_data({"a": local, "b": None}, "synthetic") == []
    assert warn_other_data({"a": {"data": {"source": "python_code"}}}, "python_code") == []
