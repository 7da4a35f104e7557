"""Lightning checkpoint -> exported draft folder (head + LoRA safetensors, config.json, README.md).

    python scripts/export.py CKPT OUT_DIR [--model tiny] [--kind cp --window 8 --rank 4]
                             [--lora-layers 0 ...] [--target-path PATH]

Settings default to the checkpoint's ``hyper_parameters`` (flat keys ``model``, ``kind``,
``window``, ``rank``, ``lora_layers``, ``lora_rank``, ``lora_alpha``, ``lora_dropout``,
``lora_target_modules``, ``path`` when present; nested ``cfg.model.name`` etc. otherwise);
flags override them. Head tensors are the state-dict entries under ``...head.``; LoRA tensors
are the ``lora_`` entries under ``...hf_model.``. The frozen target is rebuilt to attach the
weights to and is not written.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mtpc.model import MTPCModel


def _hparams(ckpt: dict[str, Any]) -> dict[str, Any]:
    hp = dict(ckpt.get("hyper_parameters") or {})
    cfg = hp.get("cfg") or {}
    if isinstance(cfg, dict):
        model, circuit, lora = (
            cfg.get("model") or {},
            cfg.get("circuit") or {},
            cfg.get("lora") or {},
        )
        hp.setdefault("model", model.get("name"))
        hp.setdefault("path", model.get("path"))
        hp.setdefault("kind", circuit.get("kind"))
        hp.setdefault("window", circuit.get("window"))
        hp.setdefault("rank", circuit.get("rank"))
        for key in ("layers", "rank", "alpha", "dropout", "target_modules"):
            hp.setdefault(f"lora_{key}", lora.get(key))
    return {k: v for k, v in hp.items() if v is not None}


def export_checkpoint(ckpt_path: str, out_dir: str, **overrides: Any) -> str:
    """Rebuilds the model from a checkpoint's settings, loads its head and LoRA, exports it."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    hp = {**_hparams(ckpt), **{k: v for k, v in overrides.items() if v is not None}}
    for key in ("model", "kind", "window", "rank"):
        if key not in hp:
            raise ValueError(f"{key} is not in the checkpoint's hyper_parameters; pass --{key}")
    lora_kwargs = {
        k: hp[k]
        for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")
        if k in hp
    }
    model = MTPCModel.from_config(
        model=hp["model"], kind=hp["kind"], window=int(hp["window"]), rank=int(hp["rank"]),
        lora_layers=int(hp.get("lora_layers", 0)), path=hp.get("path"), head_init="random", **lora_kwargs,
    )  # fmt: skip
    state = ckpt.get("state_dict", ckpt)
    head = {
        k.split("head.", 1)[1]: v for k, v in state.items() if "head." in k and "lora_" not in k
    }
    model.head.load_state_dict(head)
    if model.backbone.lora is not None:
        lora = {k.split("hf_model.", 1)[1]: v for k, v in state.items() if "lora_" in k}
        model.backbone.lora.load_state_dict(lora)
    metrics = {
        k: v for k, v in (ckpt.get("callbacks") or {}).items() if isinstance(v, (int, float, str))
    }
    model.save_pretrained(out_dir, training_config=hp, metrics=metrics or None)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ckpt")
    parser.add_argument("out_dir")
    parser.add_argument("--model", choices=["tiny", "evabyte", "llama3_byte"])
    parser.add_argument("--target-path", dest="path")
    parser.add_argument("--kind", choices=["ff", "cp", "hmm", "btree"])
    parser.add_argument("--window", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--lora-layers", type=int)
    args = parser.parse_args()
    print(export_checkpoint(**vars(args)))


if __name__ == "__main__":
    main()
