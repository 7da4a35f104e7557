"""The Python-code source (mtpc.data.python_code): rows, split by file, fingerprint, malformed
files, determinism, the data cache's split, and the pretraining script on a fake tree."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mtpc.data import python_code
from mtpc.data.cache import ensure_prepared
from mtpc.data.preprocess import check_row
from mtpc.data.python_code import (
    MAX_FILE_BYTES,
    is_validation_file,
    python_code_source,
    python_version,
)
from mtpc.data.sources import load_source
from mtpc.errors import DataError, MissingFileError

METHOD = '''    @staticmethod
    def scale(x, factor=2):
        """Multiplies x.

        Args:
            x: a number.
        """
        # a comment
        y = x * factor
        return y
'''

MODULE = f'''"""A small module."""

import os


def add(a, b):
    """Adds a and b."""
    return a + b


def undocumented(a):
    return a


def only_doc():
    """Nothing else."""


class Box:
    """A box."""

{METHOD}
'''


def write_tree(root: Path, num_files: int = 24) -> Path:
    """A fake standard library: good files, three malformed ones, an excluded test folder."""
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    for i in range(num_files):
        lines = "".join(f"value_{i}_{k} = {k}\n" for k in range(40))
        (root / "pkg" / f"mod{i:02d}.py").write_text(MODULE + lines, encoding="utf-8")
    (root / "bad_syntax.py").write_text("def broken(:\n    pass\n", encoding="utf-8")
    (root / "bad_bytes.py").write_bytes(b"x = '\xff\xfe'\n")
    (root / "too_big.py").write_text("x = 1\n" * (MAX_FILE_BYTES // 6 + 10), encoding="utf-8")
    (root / "test" / "test_secret.py").write_text(MODULE.replace("add", "secret"), "utf-8")
    (root / "notes.txt").write_text("not python", encoding="utf-8")
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "lib")


def rows_of(root: Path, **kwargs) -> tuple[list[dict], list[bool], dict]:
    src = python_code_source(root, **kwargs)
    assert src.split_mask is not None and src.report is not None
    return list(src), list(src.split_mask()), src.report()


def test_rows_are_tulu_rows_with_the_exact_source_text(tree: Path) -> None:
    rows, _, report = rows_of(tree, validation_fraction=0.3)
    assert rows and all(check_row(r) is None for r in rows)
    assert {r["source"] for r in rows} == {
        "python/function_body",
        "python/docstring",
        "python/continuation",
    }
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["file"].startswith("pkg/") and row["file"] in row["id"]
    method = next(
        r for r in rows if r["source"] == "python/function_body" and r["id"].endswith(":scale")
    )
    header = method["messages"][0]["content"].split("\n\n", 1)[1]
    # decorator, signature, docstring, then the body: the method's own lines, dedented by 4
    expected = "".join(line[4:] if line.strip() else line for line in METHOD.splitlines(True))
    assert header + method["messages"][1]["content"] == expected
    assert method["messages"][1]["content"].startswith("    # a comment\n    y = x * factor")
    doc = next(r for r in rows if r["source"] == "python/docstring" and r["id"].endswith(":scale"))
    assert (
        doc["messages"][1]["content"]
        == '    """Multiplies x.\n\n    Args:\n        x: a number.\n    """\n'
    )
    assert '"""' not in doc["messages"][0]["content"].split("\n\n", 1)[1]
    names = {r["id"].rsplit(":", 1)[1] for r in rows if r["source"] == "python/function_body"}
    assert names == {"add", "scale"}  # undocumented and docstring-only functions give no row
    assert report["functions_without_body"] == 24
    cont = [r for r in rows if r["source"] == "python/continuation" and r["file"] == "pkg/mod00.py"]
    text = "".join(r["messages"][0]["content"].split("\n\n", 1)[1] + r["messages"][1]["content"]
                   for r in cont)  # fmt: skip
    assert text == (tree / "pkg/mod00.py").read_text()[: len(text)] and len(text) > 500
    assert not any("secret" in json.dumps(r) for r in rows)  # test/ is excluded


def test_malformed_files_are_counted_and_logged(
    tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mtpc.data.python_code"):
        rows, _, report = rows_of(tree)
    assert report["malformed_files"] == {"undecodable": 1, "syntax_error": 1, "too_large": 1}
    assert report["malformed_examples"] == {
        "undecodable": ["bad_bytes.py"],
        "syntax_error": ["bad_syntax.py"],
        "too_large": ["too_big.py"],
    }
    assert report["files_seen"] == 27 and report["files_used"] == 24
    assert "3 of 27 files are malformed" in caplog.text
    assert not any(r["file"].startswith(("bad", "too")) for r in rows)


def test_split_by_file_never_leaks_through_the_cache(tree: Path, tmp_path: Path) -> None:
    src = load_source("python_code", tree, validation_fraction=0.3)
    rows = list(src)
    data = ensure_prepared(src, "tiny", tmp_path / "cache", max_bytes=4096, seed=3,
                           validation_fraction=0.3)  # fmt: skip
    row_of_doc = np.load(data.folder / "doc_row.npy")
    files = {
        s: {rows[int(row_of_doc[d])]["file"] for d in data.splits[s]} for s in ("train", "val")
    }
    assert files["train"] and files["val"] and not files["train"] & files["val"]
    expected = {r["file"] for r in rows if is_validation_file(r["file"], 0.3)}
    assert files["val"] == expected
    assert {r["file"] for r in data.val_rows()} == expected  # the prompt sets' rows
    report = data.summary["source_report"]
    assert report["malformed_files"]["syntax_error"] == 1
    assert report["validation_files"] == len(expected)


def test_num_rows_keeps_both_splits_and_the_file_split(tree: Path) -> None:
    rows, mask, report = rows_of(tree, num_rows=20, validation_fraction=0.3)
    assert len(rows) == 20 and sum(mask) == 6
    for row, held_out in zip(rows, mask, strict=True):
        assert held_out == is_validation_file(row["file"], 0.3)
    assert sum(report["rows"].values()) == 20


def test_fingerprint_follows_content(tree: Path) -> None:
    first = python_code_source(tree).fingerprint
    assert python_code_source(tree).fingerprint == first
    assert f"py{python_version()}" in first
    path = tree / "pkg" / "mod03.py"
    path.write_text(path.read_text() + "z = 0\n")
    assert python_code_source(tree).fingerprint != first
    (tree / "bad_syntax.py").write_text("def broken(:\n    return\n")  # malformed files count too
    second = python_code_source(tree).fingerprint
    assert second != first
    assert python_code_source(tree, validation_fraction=0.2).fingerprint != second
    (tree / "test" / "test_secret.py").write_text("x = 2\n")  # an excluded file does not
    assert python_code_source(tree).fingerprint == second


def test_rows_are_deterministic(tree: Path, tmp_path: Path) -> None:
    once = rows_of(tree)
    copy = write_tree(tmp_path / "copy")  # same content, written again
    assert json.dumps(rows_of(copy)[:2]) == json.dumps(once[:2])


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"validation_fraction": 1.0}, DataError, "data.validation_fraction=1.0"),
        ({"num_rows": 0}, DataError, "data.num_rows=0"),
        ({"kinds": ("functions",)}, DataError, "kinds=['functions']"),
    ],
)
def test_bad_settings_name_the_field(tree: Path, kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field.replace("[", r"\[").replace("]", r"\]")):
        python_code_source(tree, **kwargs)


def test_missing_root_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match=r"data\.path="):
        python_code_source(tmp_path / "nowhere")


def test_real_stdlib_first_rows() -> None:
    src = python_code_source(num_rows=60)
    rows, mask = list(src), list(src.split_mask())  # type: ignore[misc]
    assert len(rows) == 60 and sum(mask) == 3
    assert all(check_row(r) is None and r["source"].startswith("python/") for r in rows)
    assert not {r["file"] for r, v in zip(rows, mask, strict=True) if v} & {
        r["file"] for r, v in zip(rows, mask, strict=True) if not v
    }
    assert f"py{python_version()}" in src.fingerprint
    assert not any(part in python_code.EXCLUDED_DIRS for r in rows for part in r["file"].split("/"))


def _pretrain_script() -> Any:
    """``scripts/pretrain_tiny_target.py`` as a module."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import pretrain_tiny_target
    finally:
        sys.path.pop(0)
    return pretrain_tiny_target


@pytest.mark.slow
def test_pretrain_script_on_a_fake_tree(tree: Path, tmp_path: Path) -> None:
    """--data python_code trains, scores held-out files and stores bf16 weights that load."""
    pretrain = _pretrain_script()
    from mtpc.backbones.tiny import load_tiny_target

    out = tmp_path / "asset"
    meta = pretrain.main([
        "--data", "python_code", "--code-root", str(tree), "--out", str(out),
        "--validation-fraction", "0.3", "--steps", "2", "--warmup", "1", "--hidden-size", "32",
        "--num-layers", "1", "--num-heads", "2", "--intermediate-size", "64", "--seq-len", "128",
        "--batch-size", "2", "--eval-windows", "3", "--eval-generations", "1", "--threads", "1",
    ])  # fmt: skip
    assert meta["stored_dtype"] == "bfloat16" and meta["data"]["malformed_files"]["too_large"] == 1
    assert meta["validation"]["windows"] == 3 and 0 < meta["validation"]["bits_per_byte"] < 10
    assert meta["rebuild_command"] == meta["command"] and "--code-root" in meta["command"]
    target = load_tiny_target(out)
    assert target.model.dtype == torch.float32 and target.metadata["num_parameters"] > 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_bundled_code_target_loads_by_name_within_the_asset_budget() -> None:
    """assets/tiny_code: bf16 on disk, float32 after loading, its metadata complete."""
    from mtpc.backbones.tiny import ASSETS_DIR, TINY_CODE_DIR, load_tiny_target

    target = load_tiny_target("tiny_code")  # a bundled name resolves to assets/tiny_code
    assert target.path == TINY_CODE_DIR and target.model.dtype == torch.float32
    assert json.loads((TINY_CODE_DIR / "config.json").read_text())["dtype"] == "bfloat16"
    meta = target.metadata
    assert meta["command"].startswith("python scripts/pretrain_tiny_target.py --data python_code")
    assert meta["num_parameters_with_mtp"] > meta["num_parameters"] > 1_000_000
    assert 0 < meta["validation"]["bits_per_byte"] < 3 and meta["train_wall_seconds"] > 0
    assert meta["greedy_samples"] and meta["data"]["validation_files"] > 0
    total = sum(f.stat().st_size for f in ASSETS_DIR.rglob("*") if f.is_file())
    assert total <= 12 * 1024 * 1024


def test_data_config_passes_path_and_fraction_to_the_source(tree: Path, tmp_path: Path) -> None:
    """data=python_code composes with model=tiny_code; its fraction reaches the source."""
    from hydra.utils import instantiate

    from tests.helpers import compose_train_cfg

    cfg = compose_train_cfg(
        tmp_path,
        [
            "model=tiny_code",
            "data=python_code",
            f"data.path={tree}",
            "data.validation_fraction=0.3",
        ],
    )
    assert cfg.run_name.startswith("tiny_code-")  # model.run_label names the run folders
    assert compose_train_cfg(tmp_path, []).run_name.startswith("tiny-")
    src = instantiate(cfg.data).row_source()
    assert src.fingerprint == python_code_source(tree, validation_fraction=0.3).fingerprint


def test_python_code_path_must_be_one_folder(tree: Path) -> None:
    with pytest.raises(DataError, match=r"data\.path=.*one folder or null"):
        load_source("python_code", [str(tree), str(tree)])


def test_asset_error_names_the_folders_own_rebuild_command(tmp_path: Path) -> None:
    from mtpc.backbones.tiny import TinyTargetAssetError, load_tiny_target

    command = "python scripts/pretrain_tiny_target.py --data python_code --steps 9"
    (tmp_path / "metadata.json").write_text(json.dumps({"rebuild_command": command}))
    with pytest.raises(TinyTargetAssetError, match="--data python_code --steps 9"):
        load_tiny_target(tmp_path)


def test_pretrain_time_budget_stops_training(tree: Path, tmp_path: Path) -> None:
    """--time-budget-s ends training before --steps; a budget <= 0 is refused up front."""
    pretrain = _pretrain_script()
    args = [
        "--data", "python_code", "--code-root", str(tree), "--out", str(tmp_path / "asset"),
        "--validation-fraction", "0.3", "--steps", "5", "--warmup", "1", "--hidden-size", "32",
        "--num-layers", "1", "--num-heads", "2", "--intermediate-size", "64", "--seq-len", "128",
        "--batch-size", "2", "--eval-windows", "1", "--eval-generations", "0", "--threads", "1",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        pretrain.parse_args([*args, "--time-budget-s", "0"])
    meta = pretrain.main([*args, "--time-budget-s", "1e-9"])
    assert meta["steps"] <= 1 and meta["args"]["time_budget_s"] == 1e-9
