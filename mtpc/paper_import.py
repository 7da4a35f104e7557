"""Import the MTPC paper's released drafts (april-tools/mtpc checkpoints) exactly.

:func:`read_paper_draft` reads and checks a folder (``config.yaml``, ``model@<step>.pt``)
without the LM; :func:`head_state` maps the head onto ours by matching sum folds by scope (a
permutation and a reshape); :func:`import_paper_draft` writes our draft format. What is mapped
and what is refused (one line, :class:`PaperImportError`, before the LM loads):
docs/EVALUATION.md, "The paper's drafts".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from mtpc.errors import MissingFileError, UserError

__all__ = ["PaperDraft", "PaperImportError", "head_state", "import_paper_draft", "read_paper_draft"]

CONFIG_FILE = "config.yaml"
CHECKPOINT_RE = re.compile(r"^model@(\d+)\.pt$")
CAT_KEY = "mt_head._categorical_log_probs_heads.0.head.proj"
SUM_KEY_RE = re.compile(r"^mt_head\._sum_weights_heads\.(\d+)\.head\.proj$")
LORA_KEY_RE = re.compile(r"^lm\._lm\.base_model\.model\.(.+\.lora_[AB]\.default\.weight)$")
BOOK_KEY_RE = re.compile(r"^circuit\..*_address_book\._in_fold_idx_(\d+)_(\d+)$")
KNOWN_CIRCUIT_BUFFERS = ("_autoregressive_mar_mask", "_univariate_mar_mask")
STRIPPED_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DDP
#: Lower-cased fragments of the paper config's LM hub id -> our ``model=`` name.
LM_MODELS = {"evabyte": "evabyte", "llama3-2-3b-it-byte": "llama3_byte"}


class PaperImportError(UserError, ValueError):
    """A paper draft that cannot be read, or cannot be mapped exactly (one line)."""


@dataclass
class PaperDraft:
    """A paper draft folder, read and checked (no LM loaded)."""

    folder: Path
    checkpoint: Path  # the model@<step>.pt read
    step: int
    config: dict[str, Any]  # the paper's resolved config.yaml
    kind: str  # our family
    window: int
    rank: int
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype  # the projections' own (bf16 in the released drafts)
    categorical: Tensor  # (n, r, V, d) input projections, in their fold order
    scope_idx: Tensor  # (n,) window position of each input fold
    sums: list[Tensor]  # per sum layer (topological order): (F, K_out, K_in, d)
    sum_scopes: list[list[frozenset[int]]]  # per sum layer, per fold: the positions below it
    lora: dict[str, Tensor] = field(default_factory=dict)  # by the HF model's names
    lora_layers: list[int] = field(default_factory=list)  # the last k of the target
    lora_settings: dict[str, Any] = field(default_factory=dict)  # rank, alpha, dropout, modules
    lm_id: str | None = None  # lm.model.from_huggingface


def _field(config: Mapping[str, Any], dotted: str, default: Any = ...) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is not ...:
                return default
            raise PaperImportError(f"{CONFIG_FILE}: field {dotted} is missing")
        node = node[part]
    return node


def _int_field(config: Mapping[str, Any], dotted: str, default: Any = ...) -> int:
    value = _field(config, dotted, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PaperImportError(f"{CONFIG_FILE}: {dotted}={value!r}; allowed: an integer >= 1")
    return value


def _read_config(folder: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    file = folder / CONFIG_FILE
    if not file.is_file():
        raise MissingFileError(
            f"{file} does not exist; expected a paper draft folder with {CONFIG_FILE} and "
            "model@<step>.pt"
        )
    try:
        raw = OmegaConf.load(file)
        config = OmegaConf.to_container(raw, resolve=True)
    except Exception as err:  # omegaconf's errors name neither the file nor the fix
        raise PaperImportError(
            f"{file} is not a readable config ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(config, dict):
        raise PaperImportError(f"{file} holds a {type(config).__name__}, not a mapping")
    return config  # type: ignore[return-value]


def _checkpoint_file(folder: Path, step: int | None) -> tuple[Path, int]:
    found = {
        int(m.group(1)): p
        for p in folder.iterdir()
        if p.is_file() and (m := CHECKPOINT_RE.match(p.name))
    }
    if not found:
        raise MissingFileError(f"{folder} holds no model@<step>.pt checkpoint")
    if step is None:
        step = max(found)
    if step not in found:
        raise PaperImportError(
            f"step={step} has no model@{step}.pt in {folder}; allowed: {sorted(found)}"
        )
    return found[step], step


def _load_state(file: Path) -> dict[str, Any]:
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: torch's error names no fix
        raise PaperImportError(
            f"{file} is not a readable checkpoint ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_state_dict"), Mapping):
        raise PaperImportError(f"{file} has no model_state_dict; not a paper checkpoint")
    state: dict[str, Any] = {}
    for key, value in ckpt["model_state_dict"].items():
        for prefix in STRIPPED_PREFIXES:
            key = key.removeprefix(prefix)
        state[key] = value
    return state


def _check_head_config(config: Mapping[str, Any]) -> None:
    hp = _field(config, "mt_head.hyperparameters")
    expected = {"type": "evabyte", "expander_type": "linear", "transformer_n_layer": 0}
    for name, want in expected.items():
        got = hp.get(name, want if name == "transformer_n_layer" else None)
        if got != want:
            raise PaperImportError(
                f"{CONFIG_FILE}: mt_head.hyperparameters.{name}={got!r}; allowed: {want!r} "
                "(only the linear expander maps exactly onto our head)"
            )
    for name, allowed in (("share_sum_weights", False), ("contextual_hmm_weights", True)):
        if bool(hp.get(name, allowed)) != allowed:
            raise PaperImportError(
                f"{CONFIG_FILE}: mt_head.hyperparameters.{name}={str(not allowed).lower()} is not "
                f"supported; allowed: {str(allowed).lower()}"
            )


def _family(config: Mapping[str, Any]) -> tuple[str, int, int]:
    kind = _field(config, "circuit.model.kind")
    n = _int_field(config, "circuit.n_token")
    r = _int_field(config, "circuit.n_component")
    s = _int_field(config, "circuit.n_repetition", 1)
    if s != 1:
        raise PaperImportError(
            f"{CONFIG_FILE}: circuit.n_repetition={s} (trees mixed at the root) has no "
            "counterpart here; allowed: 1"
        )
    if kind not in ("cp", "hmm", "btree"):
        raise PaperImportError(
            f"{CONFIG_FILE}: circuit.model.kind={kind!r}; allowed: cp, hmm, btree"
        )
    ours = "ff" if kind == "cp" and r == 1 else kind
    if ours == "btree":
        if r < 2:
            raise PaperImportError(f"{CONFIG_FILE}: circuit.n_component={r}; BTree needs >= 2")
        if n & (n - 1):
            raise PaperImportError(
                f"{CONFIG_FILE}: circuit.n_token={n}: a BTree imports exactly only for n a power "
                "of two (the released drafts: 8, 16, 32); elsewhere their split round(len/2), "
                "half to even, differs from ours (lengths 5, 9, ...) and their layers read from "
                "several layers, whose folding is not established"
            )
    return ours, n, r


def _chain_scopes(
    scope_idx: Tensor, book: Mapping[int, Tensor], kinds: list[str]
) -> list[list[frozenset[int]]]:
    """Fold scopes of every inner layer of a chain (each layer reads the one before it);
    ``book``: the stored (F, H) fold-index tensors by entry (1 = the first inner layer),
    ``kinds``: the inner layers' kinds in order."""
    prev = [frozenset([int(p)]) for p in scope_idx.tolist()]
    out = []
    for i, kind in enumerate(kinds, start=1):
        if i in book:
            idx = book[i]
        elif kind == "product":  # every fold of the layer before into one fold
            idx = torch.arange(len(prev))[None]
        else:  # fold f reads fold f
            idx = torch.arange(len(prev))[:, None]
        if (idx.shape[1] == 1) != (kind == "sum") or not 0 <= idx.min() <= idx.max() < len(prev):
            raise PaperImportError(
                f"circuit address book entry {i}: {tuple(idx.shape)} does not fit a {kind} "
                "layer reading the layer before it; this circuit's wiring cannot be mapped"
            )
        scopes = []
        for row in idx.tolist():
            parts = [prev[j] for j in row]
            scope = frozenset().union(*parts)
            if sum(len(p) for p in parts) != len(scope):
                raise PaperImportError("circuit address book: a product over overlapping scopes")
            scopes.append(scope)
        out.append(scopes)
        prev = scopes
    return out


def _sum_scopes(
    kind: str, n: int, scope_idx: Tensor, state: Mapping[str, Any]
) -> list[list[frozenset[int]]]:
    if kind == "ff":
        return []
    if kind == "hmm":
        # cirkit's hmm(ordering=0..n-1): S_{n-1}(phi_{n-1}), then S_i(S_{i+1} ⊙ phi_i) down to
        # the root S_0; each S_i is its own layer (one fold), in topological order n-1, ..., 0
        return [[frozenset(range(n - 1 - k, n))] for k in range(n)]
    if kind == "cp":
        return [[frozenset(range(n))]]
    # the circuit's stored fold-index tensors by entry (entry i: module i's inputs, in
    # topological order) and the output entry's number; cirkit stores no tensor for a gather
    # that is an unsqueeze (all folds into one, or fold f into fold f)
    book: dict[int, Tensor] = {}
    output = None
    for key, value in state.items():
        if m := BOOK_KEY_RE.match(key):
            if int(m.group(2)) != 0:
                raise PaperImportError(f"circuit buffer {key}: more than one input group per layer")
            if value.dim() == 1:
                output = int(m.group(1))
            else:
                book[int(m.group(1))] = value
    kinds = ["product", "sum"] * (n.bit_length() - 1)  # n a power of two
    if output is None or output != len(kinds) + 1:
        raise PaperImportError(
            "the checkpoint's circuit address book (_in_fold_idx_* buffers) does not describe "
            f"a BTree over {n} positions ({len(kinds)} inner layers): its fold wiring cannot be "
            "established"
        )
    layers = _chain_scopes(scope_idx, book, kinds)
    return [scopes for kind, scopes in zip(kinds, layers, strict=True) if kind == "sum"]


def read_paper_draft(folder: str | Path, step: int | None = None) -> PaperDraft:
    """Reads and checks a paper draft folder at ``step`` (default: the highest), no LM."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingFileError(f"{folder} does not exist; expected a paper draft folder")
    config = _read_config(folder)
    kind, n, r = _family(config)
    _check_head_config(config)
    if kind == "hmm" and _field(config, "mt_head.hyperparameters.init_hmm_identity", False):
        raise PaperImportError(
            f"{CONFIG_FILE}: mt_head.hyperparameters.init_hmm_identity=true: their "
            "identity-initialised HMM adds a bias term (paper App. E) whose form (learned or "
            "fixed, where it is added) the released head code does not show, so it cannot be "
            "imported exactly; allowed: false"
        )
    file, step = _checkpoint_file(folder, step)
    state = _load_state(file)
    categorical, scope, sum_list, lora = _head_tensors(file, state, kind, n, r)
    scopes = _sum_scopes(kind, n, scope, state)
    if len(scopes) != len(sum_list):
        raise PaperImportError(
            f"the checkpoint has {len(sum_list)} sum heads but its circuit ({kind}, n={n}) has "
            f"{len(scopes)} sum layers"
        )
    for k, (w, sc) in enumerate(zip(sum_list, scopes, strict=True)):
        if w.shape[0] != len(sc) or w.shape[2] != r:
            raise PaperImportError(
                f"mt_head._sum_weights_heads.{k}.head.proj has shape {tuple(w.shape)}; its "
                f"circuit layer has {len(sc)} folds of {r} inputs"
            )
    settings, layers = _lora_config(config, lora)
    lm_id = _field(config, "lm.model.from_huggingface", None)
    V, d = categorical.shape[2:]
    return PaperDraft(
        folder=folder, checkpoint=file, step=step, config=config, kind=kind, window=n,
        rank=r, vocab_size=int(V), hidden_size=int(d), dtype=categorical.dtype,
        categorical=categorical, scope_idx=scope, sums=sum_list, sum_scopes=scopes,
        lora=lora, lora_layers=layers, lora_settings=settings,
        lm_id=lm_id if isinstance(lm_id, str) else None,
    )  # fmt: skip


def _head_tensors(
    file: Path, state: Mapping[str, Any], kind: str, n: int, r: int
) -> tuple[Tensor, Tensor, list[Tensor], dict[str, Tensor]]:
    """Sorts a checkpoint's keys, refusing every key that cannot be mapped, and checks the
    head's tensors against the config's n, r and one another; returns the ``(n, r, V, d)``
    input projections, their ``(n,)`` positions, the sum projections by k and the LoRA
    weights by our names."""
    sums: dict[int, Tensor] = {}
    categorical: Tensor | None = None
    scope_keys: list[str] = []
    lora: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("lm."):
            m = LORA_KEY_RE.match(key)
            if m and isinstance(value, Tensor):
                lora[m.group(1)] = value
            elif value is not None:
                raise PaperImportError(
                    f"checkpoint key {key} carries LM weights: a fine-tuned LM cannot be "
                    "imported as a draft of the frozen target"
                )
            continue
        if not isinstance(value, Tensor):
            raise PaperImportError(
                f"checkpoint key {key} holds {type(value).__name__}, not a tensor"
            )
        if key.startswith("mt_head."):
            m = SUM_KEY_RE.match(key)
            if key == CAT_KEY:
                categorical = value
            elif m:
                sums[int(m.group(1))] = value
            else:
                _refuse_head_key(key, kind)
        elif key.startswith("circuit."):
            if key.endswith("._scope_idx"):
                scope_keys.append(key)
            elif value.is_floating_point() and not key.endswith(KNOWN_CIRCUIT_BUFFERS):
                raise PaperImportError(
                    f"checkpoint key {key} is a circuit parameter; the paper's circuits carry "
                    "buffers only (their parameters come from the head)"
                )
        else:
            raise PaperImportError(f"checkpoint key {key} is neither lm.*, mt_head.* nor circuit.*")
    if categorical is None:
        raise PaperImportError(f"{file}: key {CAT_KEY} is missing")
    if categorical.dim() != 4 or categorical.shape[:2] != (n, r):
        raise PaperImportError(
            f"{CAT_KEY} has shape {tuple(categorical.shape)}; config.yaml circuit (n={n}, "
            f"r={r}) needs ({n}, {r}, V, d)"
        )
    if len(scope_keys) != 1:
        raise PaperImportError(
            f"{file}: expected one circuit input layer (_scope_idx buffer), found {len(scope_keys)}"
        )
    scope = state[scope_keys[0]].reshape(-1)
    if sorted(scope.tolist()) != list(range(n)):
        raise PaperImportError(
            f"{scope_keys[0]} is {scope.tolist()}; expected a permutation of 0..{n - 1}"
        )
    if sorted(sums) != list(range(len(sums))):
        raise PaperImportError(f"sum heads {sorted(sums)} are not numbered 0..{len(sums) - 1}")
    sum_list = [sums[k] for k in range(len(sums))]
    d = categorical.shape[3]
    for k, w in enumerate(sum_list):
        if w.dim() != 4 or w.shape[3] != d or w.dtype != categorical.dtype:
            raise PaperImportError(
                f"mt_head._sum_weights_heads.{k}.head.proj has shape {tuple(w.shape)} "
                f"{w.dtype}; expected (F, K_out, K_in, d={d}) {categorical.dtype}"
            )
    for name, t in [(CAT_KEY, categorical)] + [
        (f"mt_head._sum_weights_heads.{k}.head.proj", w) for k, w in enumerate(sum_list)
    ]:
        if not bool(torch.isfinite(t).all()):
            raise PaperImportError(f"{file}: {name} holds NaN or inf values")
    return categorical, scope, sum_list, lora


def _refuse_head_key(key: str, kind: str) -> NoReturn:
    """Raises the one-line refusal of an ``mt_head`` key that is not a linear projection."""
    if key == "mt_head._norm.weight":
        raise PaperImportError(
            f"checkpoint key {key}: this version of their head normalises the features "
            "again (an RMSNorm before the projections), which our head does not"
        )
    if kind == "hmm":
        raise PaperImportError(
            f"checkpoint key {key}: an HMM draft with keys beyond the linear "
            "projections (the HMM bias of paper App. E?) cannot be imported: its form "
            "is not established from the released code"
        )
    raise PaperImportError(
        f"checkpoint key {key} is not a linear expander projection; only "
        f"{CAT_KEY} and mt_head._sum_weights_heads.<k>.head.proj map exactly"
    )


def _lora_config(
    config: Mapping[str, Any], lora: Mapping[str, Tensor]
) -> tuple[dict[str, Any], list[int]]:
    hp = _field(config, "adaptor.hyperparameters", None) or {}
    if not hp or not hp.get("layers_to_transform"):
        if lora:
            raise PaperImportError(
                f"the checkpoint has LoRA weights ({next(iter(lora))}) but config.yaml "
                "adaptor.hyperparameters.layers_to_transform is empty"
            )
        return {}, []
    layers = sorted(int(i) for i in hp["layers_to_transform"])
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise PaperImportError(
            f"{CONFIG_FILE}: adaptor.hyperparameters.layers_to_transform={layers}; allowed: "
            "the last k layers (a contiguous range ending at the last layer)"
        )
    if not lora:
        raise PaperImportError(
            f"{CONFIG_FILE} puts LoRA on layers {layers} but the checkpoint has no lora_ weights"
        )
    settings = {
        "rank": _int_field(config, "adaptor.hyperparameters.r"),
        "alpha": float(_field(config, "adaptor.hyperparameters.lora_alpha")),
        "dropout": float(hp.get("lora_dropout", 0.0)),
        "target_modules": list(_field(config, "adaptor.hyperparameters.target_modules")),
    }
    return settings, layers


def head_state(draft: PaperDraft, structure: Any) -> dict[str, Tensor]:
    """Our ``MTPCHead`` state dict (``unembedding``, ``sum_proj``, ``sum_bias``) of a paper draft;
    ``structure``: ours of the same family, n, r (every sum contextual, nothing tied). Their
    ``proj[f, o, i]`` is our ``sum_proj`` row ``u * r + i`` for our sum unit ``u`` with the
    same scope and output unit ``o``; every bias is zero."""
    r, d = draft.rank, draft.hidden_size
    unembedding = torch.empty_like(draft.categorical)  # (n, r, V, d)
    unembedding[draft.scope_idx] = draft.categorical  # their fold f is window position scope[f]
    theirs = {scope: (k, f) for k, sc in enumerate(draft.sum_scopes) for f, scope in enumerate(sc)}
    P = structure.num_param_rows
    sum_proj = torch.zeros(P, r, d, dtype=draft.dtype)  # (P, r, d): our row u, input unit i
    matched = 0
    for layer in structure.layers:
        if layer.kind != "sum":
            continue
        for f, scope in enumerate(layer.scopes):
            key = frozenset(scope)
            if key not in theirs:
                raise PaperImportError(
                    f"our {structure.kind} sum over positions {sorted(key)} has no paper sum "
                    "fold with that scope; the circuits differ"
                )
            k, g = theirs[key]
            w = draft.sums[k][g]  # (K_out, K_in, d)
            if w.shape[0] != layer.num_units:
                raise PaperImportError(
                    f"paper sum layer {k} fold {g} has {w.shape[0]} outputs; ours over "
                    f"{sorted(key)} has {layer.num_units}"
                )
            rows = layer.sum_offset + f * layer.num_units + torch.arange(layer.num_units)
            sum_proj[structure.sum_tie[rows]] = w
            matched += 1
    if matched != len(theirs):
        raise PaperImportError(
            f"the paper circuit has {len(theirs)} sum folds, ours {matched}; the circuits differ"
        )
    return {
        "unembedding": unembedding,
        "sum_proj": sum_proj.reshape(P * r, d),
        "sum_bias": torch.zeros(P, r, dtype=draft.dtype),
    }


def _target_name(
    draft: PaperDraft, model: str | None, model_path: str | None
) -> tuple[str, str | None]:
    if model is not None:
        return model, model_path
    lm = (draft.lm_id or "").lower()
    for fragment, name in LM_MODELS.items():
        if fragment in lm:
            return name, model_path or draft.lm_id
    raise PaperImportError(
        f"{CONFIG_FILE}: lm.model.from_huggingface={draft.lm_id!r} is not a known target; "
        "give --model (tiny, evabyte, llama3_byte) and --model-path"
    )


def import_paper_draft(
    folder: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    model: str | None = None,
    model_path: str | None = None,
    revision: str | None = None,
    target: Any = None,
    device: str = "cpu",
    dtype: str | None = None,
) -> Path:
    """Imports a paper draft folder into our draft format at ``out``; returns ``out``. The
    target: ``target``, else ``model`` / ``model_path`` (default: from the config's LM hub id)
    in ``dtype`` (default bf16 for the real targets)."""
    from mtpc.backbones import backbone_from_hf, load_backbone
    from mtpc.export import CONFIG_NAME, save_draft
    from mtpc.model import MTPCModel

    draft = read_paper_draft(folder, step)
    if target is not None:
        backbone = backbone_from_hf(target)
    else:
        name, path = _target_name(draft, model, model_path)
        if dtype is None:  # the tiny target loads in load_backbone's default, float32
            dtype = "float32" if name == "tiny" else "bfloat16"
        backbone = load_backbone(name, path=path, revision=revision, dtype=dtype, device=device)
    if (backbone.vocab_size, backbone.hidden_size) != (draft.vocab_size, draft.hidden_size):
        raise PaperImportError(
            f"the draft's head has V={draft.vocab_size}, d={draft.hidden_size} but the target "
            f"has V={backbone.vocab_size}, d={backbone.hidden_size}; give the target it was "
            "trained on (--model / --model-path)"
        )
    k, L = len(draft.lora_layers), backbone.num_layers
    if k and draft.lora_layers != list(range(L - k, L)):
        raise PaperImportError(
            f"{CONFIG_FILE}: LoRA on layers {draft.lora_layers}; the target has {L} layers, so "
            f"only the last k ({list(range(L - k, L))}) map onto our draft tail"
        )
    identity = draft.kind not in ("hmm", "btree")  # their sums start without the identity
    lora = draft.lora_settings
    try:
        model_ = MTPCModel.from_backbone(
            backbone, draft.kind, draft.window, draft.rank, lora_layers=k,
            lora_rank=lora.get("rank", 16), lora_alpha=lora.get("alpha", 16.0),
            lora_dropout=lora.get("dropout", 0.0), lora_target_modules=lora.get("target_modules"),
            head_init="random", head_dtype=str(draft.dtype).removeprefix("torch."),
            sum_init_std=0.0, identity_init=identity,
        )  # fmt: skip
    except ValueError as err:
        raise PaperImportError(f"the paper draft does not fit the target: {err}") from err
    model_.head.load_state_dict(head_state(draft, model_.head.structure))  # copied to its device
    if draft.lora:
        assert backbone.lora is not None
        try:
            backbone.lora.load_state_dict(draft.lora)
        except ValueError as err:
            raise PaperImportError(f"LoRA weights do not fit the target: {err}") from err
    provenance = {  # where the draft came from: the card's training config and config.json
        "from": "april-tools/mtpc",
        "folder": str(draft.folder.resolve()),
        "checkpoint": draft.checkpoint.name,
        "step": draft.step,
        "lm": draft.lm_id,
        "paper_config": draft.config,
    }
    outdir = save_draft(model_, out, training_config=provenance)
    file = outdir / CONFIG_NAME  # save_draft's config.json, plus where the draft came from
    config = json.loads(file.read_text(encoding="utf-8"))
    config["imported"] = provenance
    file.write_text(json.dumps(config, indent=2, default=str) + "\n", encoding="utf-8")
    return outdir


def main(argv: list[str] | None = None) -> Path:
    """``scripts/import_paper_draft.py``: a user error is one line on stderr, exit code 2."""
    import argparse

    from mtpc.choices import MODEL_NAMES
    from mtpc.errors import run_reporting_user_errors

    parser = argparse.ArgumentParser(
        description="Import a draft of the MTPC paper (april-tools/mtpc: config.yaml + "
        "model@<step>.pt) into this project's draft format (eval.py draft=<out>)."
    )
    parser.add_argument("folder", help="the paper draft folder (config.yaml, model@<step>.pt)")
    parser.add_argument("--out", required=True, help="the draft folder to write")
    parser.add_argument("--step", type=int, help="checkpoint step (default: last)")
    parser.add_argument(
        "--model",
        choices=list(MODEL_NAMES),
        help="our target name (default: from the config's lm.model.from_huggingface)",
    )
    parser.add_argument(
        "--model-path", help="local checkpoint or hub id of the target (model.path=)"
    )
    parser.add_argument("--revision", help="hub revision of the target")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="target dtype (default: bf16 for real targets)")
    args = parser.parse_args(argv)

    def run() -> Path:
        out = import_paper_draft(
            args.folder, args.out, step=args.step, model=args.model,
            model_path=args.model_path, revision=args.revision, device=args.device,
            dtype=args.dtype,
        )  # fmt: skip
        print(f"imported {args.folder} -> {out} (evaluate: python eval.py draft={out})")
        return out

    return run_reporting_user_errors(run)
