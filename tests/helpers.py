"""Config and draft helpers several test modules share (stand-in models live in fakes.py).

``compose_train_cfg``: a composed training config that writes only under ``tmp_path``;
``eval_cfg``: a complete evaluation config on the tiny target; ``make_drafts``: untrained
drafts of random tiny targets, saved as ``eval.py`` loads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict
from transformers import LlamaConfig, LlamaForCausalLM

from mtpc.model import MTPCModel

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
TINY_VOCAB = 320  # the tiny codec's vocabulary (eval prompts come from the data pipeline)
EXTRA_PLUGINS = {
    "slurm": "hydra_plugins.hydra_submitit_launcher",
    "sweep": "hydra_plugins.hydra_optuna_sweeper",
}
"""The Hydra plugin each optional extra of pyproject.toml (not in ``dev``) installs."""


def require_extra(extra: str) -> None:
    """Skips the calling test, with the install command, when ``extra`` is not installed."""
    pytest.importorskip(
        EXTRA_PLUGINS[extra], reason=f"needs the {extra} extra: pip install -e '.[{extra}]'"
    )


# ---------------------------------------------------------------------------- training ----
def compose_train_cfg(
    tmp_path: Path, overrides: list[str], name: str = "run", fast: Sequence[str] = ()
) -> DictConfig:
    """The training config of ``fast + overrides``, writing only under ``tmp_path``."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*fast, *overrides], return_hydra_config=False)
    with open_dict(cfg):
        cfg.paths.root_dir = str(tmp_path)
        cfg.paths.cache_dir = str(tmp_path / "cache")
        cfg.paths.output_dir = str(tmp_path / name)
        cfg.run_dir = str(tmp_path / name)
    return cfg


# -------------------------------------------------------------------------- evaluation ----
def _save_target(path: Path, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    return LlamaForCausalLM.from_pretrained(path).eval()


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


def eval_cfg(tmp_path: Path, **over: Any) -> dict[str, Any]:
    """A complete evaluation config on the tiny target (no draft yet), ``over`` on top."""
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
        "temperature": 1.0, "top_k": None, "top_p": None,
        "suppress_eos": True, "max_throughput": True, "plots": True,
        "output_dir": str(tmp_path / "out"),
    }  # fmt: skip
    cfg.update(over)
    return cfg


def interpreter_scenarios(script: str, *args: str, timeout: int) -> dict[str, Any]:
    """Runs ``script`` (which prints ``SCENARIOS <json>``) in a subprocess under triton's CPU
    interpreter (``TRITON_INTERPRET`` must be set before triton is imported) and returns the
    JSON; the default GPU capability (no ``MTPC_TRITON_CAPABILITY``)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MTPC_TRITON_CAPABILITY", None)
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    line = next((x for x in result.stdout.splitlines() if x.startswith("SCENARIOS ")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-3000:]
    found: dict[str, Any] = json.loads(line.removeprefix("SCENARIOS "))
    return found


EVABYTE_CODE = os.environ.get("MTPC_EVABYTE_CODE")
"""A directory with EvaByte's real remote code (``evabyte_hf/*.py``, OpenEvaByte/evabyte @
432331a; never committed), or None: the tests that need it skip."""

needs_evabyte_code = pytest.mark.skipif(
    not EVABYTE_CODE,
    reason="set MTPC_EVABYTE_CODE=<dir with evabyte_hf/*.py> (EvaByte's real remote code, "
    "OpenEvaByte/evabyte @ 432331a; never committed) to run it",
)


def evabyte_checkpoint(root: Path, **overrides: Any) -> Path:
    """A tiny random checkpoint of EvaByte's real code (``scripts/check_remote_code.py``'s:
    3 layers, EVA window 16, chunk 4; ``overrides`` replace config fields), under ``root``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mtpc_check_remote_code", REPO / "scripts" / "check_remote_code.py"
    )
    assert spec is not None and spec.loader is not None and EVABYTE_CODE
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    code = Path(EVABYTE_CODE)
    code = code / "evabyte_hf" if (code / "evabyte_hf").is_dir() else code
    sizes = {"max_position_embeddings": 512, **overrides}
    folder, _ = tools.write_checkpoint("evabyte", code, "default", root, **sizes)
    return Path(folder)


def run_under_triton_interpreter(tmp_path: Path, script: str) -> None:
    """Runs ``script`` (``{path}``: a tiny EvaByte checkpoint of window 128, the triton
    kernels' block) in a child process under triton's CPU interpreter; it must print
    ``equal`` last."""
    folder = evabyte_checkpoint(tmp_path, window_size=128, num_hidden_layers=2)
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script.format(path=str(folder))], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "equal", done.stdout[-2000:]
