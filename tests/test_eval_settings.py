"""The evaluation's and the regeneration's settings (``mtpc.evaluation.settings``): read once at
the door, with eval.yaml's defaults, checked before any model work, frozen; the raw config's
dotted lookup is the schema reader's only (mtpc/config.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hydra import compose, initialize_config_dir

from mtpc.config import ConfigError
from mtpc.evaluation.settings import (
    EvalConfigError,
    EvalDecoding,
    EvalOutput,
    EvalPrompts,
    EvalRun,
    EvalSettings,
    ModelSettings,
    parse_eval,
)
from mtpc.regeneration import RegenerateSettings, Settings, parse_regenerate
from tests.helpers import eval_cfg

ROOT = Path(__file__).resolve().parents[1]


def composed(config: str, *overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config, overrides=list(overrides))


def test_the_embedded_default_parses_to_the_documented_defaults() -> None:
    s = parse_eval(composed("eval"))
    assert s.decoding == EvalDecoding()  # eval.yaml's values are the dataclasses' defaults
    assert s.run == EvalRun()
    assert s.prompts == EvalPrompts()
    assert s.output == dataclasses.replace(EvalOutput(), root_dir=s.output.root_dir)
    assert s.decoding.max_new_tokens == 128 and s.decoding.suppress_eos is False
    assert s.run.batch_size == 1 and s.prompts.num_prompts == 8 and s.drafter is None
    assert s.model.name == "tiny" and s.model.codec == "tiny" and s.draft is None
    # a config without the fields gets the same values: each default is written once
    bare = EvalSettings.from_cfg({})
    assert (bare.decoding, bare.run, bare.prompts) == (s.decoding, s.run, s.prompts)
    assert bare.model == ModelSettings()


def test_the_regeneration_default_parses_to_the_documented_defaults() -> None:
    s = parse_regenerate(composed("regenerate", "progress=false"))
    assert s.decoder == Settings()
    assert (s.shard, s.num_shards, s.batch_size, s.device, s.num_threads) == (0, 1, 1, "cpu", 1)
    assert s.output_dir.endswith("outputs/regenerate/tiny-synthetic-greedy-seed0")
    bare = RegenerateSettings.from_cfg({"max_new_tokens": 1024})
    assert bare.decoder == s.decoder and bare.batch_size == s.batch_size


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ("batch_size=0", EvalConfigError, r"batch_size=0 is not allowed; allowed: an integer >= 1"),
        (
            "batch_size=x",
            EvalConfigError,
            r"batch_size='x' is not allowed; allowed: an integer >= 1",
        ),
        (
            "batch_size=true",
            EvalConfigError,
            r"batch_size=True is not allowed; allowed: an integer",
        ),
        ("seed=-1", ConfigError, r"seed=-1 is not allowed; allowed: an integer >= 0"),
        ("max_new_tokens=0", ConfigError, r"max_new_tokens=0 is not allowed; allowed: an integer"),
        ("warmup=-1", EvalConfigError, r"warmup=-1 is not allowed; allowed: an integer >= 0"),
        (
            "resume=bad",
            EvalConfigError,
            r"resume='bad' is not allowed; allowed: auto, force, never",
        ),
    ],
)
def test_a_bad_value_fails_in_one_line_before_any_model_work(
    tmp_path: Path, override: str, error: type[Exception], message: str
) -> None:
    cfg = composed("eval", override, f"paths.root_dir={tmp_path}")
    with pytest.raises(error, match=message) as caught:
        parse_eval(cfg)
    assert "\n" not in str(caught.value)
    from mtpc.evaluation.run import evaluate

    with (
        mock.patch("mtpc.evaluation.run.load_for_eval", side_effect=AssertionError("loaded")),
        mock.patch("mtpc.evaluation.run.resolve_drafts", side_effect=AssertionError("drafts")),
        pytest.raises(error, match=message),
    ):
        evaluate(cfg)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("batch_size=0", r"batch_size=0 is not allowed; allowed: an integer >= 1"),
        ("batch_size=x", r"batch_size='x' is not allowed; allowed: an integer >= 1"),
        ("seed=-1", r"seed=-1 is not allowed; allowed: an integer >= 0"),
    ],
)
def test_a_bad_regeneration_value_fails_before_the_target_loads(
    tmp_path: Path, override: str, message: str
) -> None:
    from mtpc.regeneration import regenerate

    cfg = composed("regenerate", "progress=false", override, f"output_dir={tmp_path / 'out'}")
    with (
        mock.patch("mtpc.regeneration.load_target", side_effect=AssertionError("loaded")),
        pytest.raises(ConfigError, match=message) as caught,
    ):
        regenerate(cfg)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_batch_size_above_1_is_another_evaluation_folder(tmp_path: Path) -> None:
    """A batch's times are rows' shares of batch cycles (another timing protocol): another
    folder; batch_size=1 leaves the key of folders made before batching existed."""
    from mtpc.evaluation.folders import build_manifest
    from mtpc.evaluation.records import folder_name

    names = {
        b: folder_name(build_manifest(parse_eval(eval_cfg(tmp_path, batch_size=b)), [], []))
        for b in (1, 4, 8)
    }
    assert len(set(names.values())) == 3
    assert "batch_size" not in build_manifest(parse_eval(eval_cfg(tmp_path)), [], [])["settings"]


def test_the_settings_are_frozen() -> None:
    s = EvalSettings.from_cfg(composed("eval"))
    for obj, name in ((s, "draft"), (s.decoding, "seed"), (s.run, "batch_size"),
                      (s.prompts, "num_prompts"), (s.output, "resume"), (s.model, "name")):  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    r = RegenerateSettings.from_cfg(composed("regenerate"))
    for obj, name in ((r, "batch_size"), (r.decoder, "seed")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)


def test_only_the_schema_reader_reads_the_raw_config() -> None:
    """No dotted config lookup (``OmegaConf.select``, a ``get_field(`` / ``_get(`` getter) but
    the schema's reader's (``mtpc/config.py``): a regression fails here."""
    readers = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "mtpc").rglob("*.py")
        if re.search(
            r"\bget_field\(|\b_get\(|OmegaConf\.select\(", path.read_text(encoding="utf-8")
        )
    }
    assert readers == {"mtpc/config.py"}
