"""Save and load trained drafts (head + LoRA adapter, never the frozen target; the files:
docs/BACKBONES.md, "Export"). An unreadable file, a shape that does not match the circuit, a
NaN / inf weight or a codec that is not the target's is a ``DraftError`` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mtpc.errors import DraftError, UserError

FORMAT = "mtpc-draft"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
HEAD_NAME = "head.safetensors"
ADAPTER_NAME = "adapter.safetensors"
CARD_NAME = "README.md"


class TargetMismatchError(UserError, ValueError):
    """The draft was exported for another target."""


def draft_config(model: Any) -> dict[str, Any]:
    """The ``config.json`` contents of ``model`` (an ``MTPCModel``)."""
    import mtpc

    head, backbone = model.head, model.backbone
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mtpc_version": mtpc.__version__,
        "circuit": {
            "kind": head.kind,
            "window": head.window,
            "rank": head.rank,
            "vocab_size": head.vocab_size,
            "hidden_size": head.hidden_size,
            "dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
            "homogeneous": head.homogeneous,  # these two change the parameter shapes
            "contextual_transitions": head.contextual_transitions,
            "init": head.init_options(),
        },
        "head_init": model.head_init,
        "lora": model.lora.to_dict(),
        "target": target_identity(backbone, model.target_fingerprint()),
        "codec": backbone.codec,
    }


def target_identity(backbone: Any, fingerprint: str) -> dict[str, Any]:
    """How to rebuild the target and how to recognise it."""
    return {
        **backbone.source,
        "backbone": type(backbone).__name__,
        "num_layers": backbone.num_layers,
        "weights_fingerprint": fingerprint,
        "dtype": str(backbone.dtype).removeprefix("torch."),
    }


def _target_label(target: dict[str, Any]) -> str:
    where = target.get("path") or (
        "bundled assets" if target.get("model") == "tiny" else "unknown path"
    )
    rev = f"@{target['revision']}" if target.get("revision") else ""
    return f"{target.get('model')} ({where}{rev}, weights {str(target.get('weights_fingerprint'))[:12]})"


def model_card(
    config: dict[str, Any], training: dict[str, Any] | None, metrics: dict[str, Any] | None
) -> str:
    """A README.md for an exported draft."""
    c, lora, t = config["circuit"], config["lora"], config["target"]
    lines = [
        f"# MTPC draft: {c['kind']} n={c['window']} r={c['rank']}, LoRA k={lora['layers']}",
        "",
        "A multi-token-prediction draft head built as a probabilistic circuit (MTPC) for the",
        f"target `{t.get('path') or t.get('model')}`. The frozen target is **not** included:",
        "load it with",
        "",
        "```python",
        "import mtpc",
        "model = mtpc.MTPCModel.from_pretrained('<this folder>')            # rebuilds the target",
        "model = mtpc.MTPCModel.from_pretrained('<this folder>', target=hf)  # or attaches to one",
        "```",
        "",
        "| field | value |",
        "|---|---|",
        f"| circuit | {c['kind']} (window n={c['window']}, rank r={c['rank']}, V={c['vocab_size']}, d={c['hidden_size']}) |",
        f"| head init | {config['head_init']} |",
        f"| LoRA | k={lora['layers']} layers, rank {lora['rank']}, alpha {lora['alpha']}, dropout {lora['dropout']}, modules {', '.join(lora['target_modules'])} |",
        f"| target | {_target_label(t)} |",
        f"| target revision | {t.get('revision')} |",
        f"| target weights fingerprint | `{t.get('weights_fingerprint')}` |",
        f"| codec | {config['codec']} |",
        "",
    ]
    if training:
        lines += [
            "## Training config",
            "",
            "```json",
            json.dumps(training, indent=2, default=str),
            "```",
            "",
        ]
    if metrics:
        lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in metrics.items()]
        lines.append("")
    return "\n".join(lines)


def save_draft(
    model: Any,
    path: str | Path,
    training_config: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> Path:
    """Writes the draft of ``model`` to the folder ``path`` (created if needed); returns it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = draft_config(model)
    head_state = {k: v.detach().contiguous().cpu() for k, v in model.head.state_dict().items()}
    save_file(head_state, out / HEAD_NAME, metadata={"format": FORMAT})
    lora = model.lora_state_dict()
    if lora:
        save_file({k: v.contiguous().cpu() for k, v in lora.items()}, out / ADAPTER_NAME)
    else:
        (out / ADAPTER_NAME).unlink(missing_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / CARD_NAME).write_text(model_card(config, training_config, metrics), encoding="utf-8")
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """Reads and checks an exported draft's ``config.json`` (DraftError if it is not one)."""
    folder = Path(path)
    file = folder / CONFIG_NAME
    if not file.is_file():
        if (folder / "draft" / CONFIG_NAME).is_file():
            raise DraftError(
                f"{folder} is a training run folder, not an exported draft; use "
                f"draft={folder / 'draft'}"
            )
        raise DraftError(f"{file} does not exist; expected an exported MTPC draft folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DraftError(f"{file} is not valid JSON ({err}); re-export the draft") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise DraftError(f"{file}: format is {found!r}; expected {FORMAT!r}")
    for key in ("circuit", "lora", "target", "codec"):
        if key not in config:
            raise DraftError(f"{file}: field {key!r} is missing")
    return config


def read_tensors(file: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Reads a draft's safetensors file, refusing missing or unreadable files and NaN / inf."""
    file = Path(file)
    if not file.is_file():
        raise DraftError(f"{file} does not exist; re-export the draft")
    try:
        state = load_file(file, device=device)
    except Exception as err:  # safetensors' own error names neither the file nor the fix
        raise DraftError(
            f"{file} is not a readable safetensors file ({err}); re-export the draft"
        ) from err
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise DraftError(
                f"{file}: tensor {name!r} holds NaN or inf values; the draft is corrupt or its "
                "training diverged: re-export it from a good checkpoint"
            )
    return state


def check_target(expected: dict[str, Any], backbone: Any) -> str:
    """The target's weights fingerprint; TargetMismatchError when it is not the recorded one."""
    got = target_identity(backbone, backbone.weights_fingerprint())
    if any(got[key] != expected.get(key) for key in ("weights_fingerprint", "num_layers")):
        raise TargetMismatchError(
            f"this draft was exported for target {_target_label(expected)}, "
            f"but the given target is {_target_label(got)}; load the draft against the target it was trained for"
        )
    return str(got["weights_fingerprint"])


def read_head(
    folder: Path, config: dict[str, Any], head: torch.nn.Module, device: Any
) -> dict[str, torch.Tensor]:
    """The head tensors of a draft on ``device``; DraftError unless they match ``head`` (built
    from ``config``)."""
    state = read_tensors(folder / HEAD_NAME, device=str(device))
    own = head.state_dict()
    c = config["circuit"]
    circuit = f"kind={c['kind']!r}, window={c['window']}, rank={c['rank']}"
    if set(own) != set(state):
        raise DraftError(
            f"head.safetensors does not match config.json circuit ({circuit}): tensors "
            f"{sorted(set(state) ^ set(own))[:4]} differ"
        )
    for name, t in own.items():
        if tuple(t.shape) != tuple(state[name].shape):
            raise DraftError(
                f"head.safetensors tensor {name!r} has shape {tuple(state[name].shape)} but "
                f"config.json circuit ({circuit}) needs {tuple(t.shape)}"
            )
    return state


def check_codec(config: dict[str, Any], backbone: Any, folder: Path) -> None:
    """Refuses a draft whose recorded codec is not its target's (the codec is the target's)."""
    if config["codec"] != backbone.codec:
        raise DraftError(
            f"{folder / CONFIG_NAME} names codec {config['codec']!r} but its target "
            f"{_target_label(config['target'])} uses codec {backbone.codec!r}; the codec comes "
            "from the target: re-export the draft (or fix the codec field)"
        )


def read_adapter(folder: Path, layers: int, device: Any) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a draft with ``lora.layers = layers`` (> 0)."""
    file = folder / ADAPTER_NAME
    if not file.is_file():
        raise DraftError(f"{file} is missing but config.json lora.layers is {layers}")
    return read_tensors(file, device=str(device))
