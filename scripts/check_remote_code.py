"""Conformance of our loaders and adapters with a target's real remote modelling code.

Takes a directory holding the real remote code (a hub snapshot's ``*.py``, or EvaByte's
``evabyte_hf/`` / tokenkit's ``tokenkit/hf/`` from their repositories), builds a tiny random
model of it, saves it as a hub-style checkpoint (``config.json`` in the 4.4x form with
``auto_map``, the remote ``*.py``, ``model.safetensors``) and checks, on CPU:

1. ``load_backbone(kind, path=<checkpoint>)`` loads it (attention on the pure-torch path) and
   passes the load-time sanity check;
2. every non-persistent buffer of the loaded model equals the directly built model's;
3. the loaded model's own forward gives the directly built model's logits;
4. the backbone's split path (embed, layers, norm, STP head) gives the same logits;
5. greedy self-speculative and autoregressive decoding through ``mtpc.generate`` (random
   LoRA on the last layer) equal the directly built model's own greedy decoding (argmax of
   its full forward, one id at a time) for prompt lengths across EVA's chunk and window
   boundaries.

EvaByte only (one trunk pass per cycle, ``mtpc/backbones/evabyte.py``):

6. a verify window run in one cached pass gives the logits of the same positions fed one
   per pass, and the model's own full forward's (float tolerance), across a window boundary;
7. greedy self-speculative decoding with n = 16 (drafts trimmed at every EVA window
   boundary) equals the model's own greedy decoding (same prompts as 5);
8. the triton path's multibyte forward, as far as it runs without a GPU: the real
   ``eva.py`` ``EvaAttention._multibyte_decoding_forward`` (SDPA, no kernel; eva.py imported
   with its two kernel modules stubbed) on our window cache, with our mask and rotary, gives
   the output and writes the keys/values of our pure-torch ``multibyte_attention``.
   ``triton_eva_prep_kv_fwd`` (the window compression) and the triton prefill are not run.

The directly built model is the remote class's own ``__init__`` on CPU (its buffers computed
for real). Under transformers 5 the remote classes cannot even be built without the config
view of ``mtpc.backbones.compat`` (rope_scaling, missing keys), which it therefore uses.

    python scripts/check_remote_code.py evabyte <dir with evabyte_hf/*.py>
    python scripts/check_remote_code.py llama3_byte <dir with tokenkit/hf/*.py> --rope llama3
    python scripts/check_remote_code.py llama3_byte <dir with tokenkit/hf/*.py> --rope default

Exit status 0 when every check passes; the report is printed as JSON.

``--save DIR`` only writes the tiny random checkpoint to ``DIR`` (no checks), with EVA sizes
from ``--window-size`` / ``--chunk-size`` (EvaByte): a ``model.path=DIR`` for ``train.py`` /
``eval.py``, e.g. EvaByte's triton kernels on a CPU (docs/TRAINING.md, "EvaByte's kernels
on a CPU"):

    python scripts/check_remote_code.py evabyte <dir with evabyte_hf/*.py> --save outputs/eva-tiny \
        --window-size 128 --chunk-size 4
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import sys
import tempfile
import types
import uuid
from pathlib import Path
from typing import Any

import torch

from mtpc.backbones import load_backbone
from mtpc.backbones.compat import (
    OPTIONAL_PACKAGES,
    install_removed_module_shims,
    non_persistent_buffers,
    patch_remote_config,
    patch_remote_module,
    remote_imports,
)
from mtpc.decoding import generate
from mtpc.model import MTPCModel

EVABYTE_CONFIG: dict[str, Any] = {
    "architectures": ["EvaByteForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_evabyte.EvaByteConfig",
        "AutoModelForCausalLM": "modeling_evabyte.EvaByteForCausalLM",
    },
    "model_type": "evabyte",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "window_size": 16,
    "chunk_size": 4,
    "num_pred_heads": 8,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

LLAMA3_BYTE_CONFIG: dict[str, Any] = {
    "architectures": ["TPULlamaForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_tpu_llama.TPULlamaConfig",
        "AutoModelForCausalLM": "modelling_tpu_llama.TPULlamaForCausalLM",
    },
    "model_type": "tpu_llama",
    "vocab_size": 272,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 500000.0,
    "bos_token_id": 256,
    "eos_token_id": 259,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "attn_implementation": "eager",
    "expand_input_ids": True,
    "expand_input_ids_maxlen": 3,
    "expand_input_ids_vocab_size": 40,
}

ROPE_SCALING = {
    "default": None,
    "llama3": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
    "linear": {"type": "linear", "factor": 2.0},
}


def expand_table(vocab: int, expand_vocab: int) -> list[Any]:
    """tokenkit's serialised expansion table: {"a,b": id} over shifted ids, and singles."""
    table: dict[str, int] = {}
    for a in range(1, vocab + 1):
        table[str(a)] = a % (expand_vocab - 1) + 1
        for b in range(1, 40):
            table[f"{a},{b}"] = (7 * a + 3 * b) % (expand_vocab - 1) + 1
    singles = [a for a in range(1, vocab + 1) if a % 11 == 0]
    return [table, singles]


def remote_class(folder: Path, kind: str) -> tuple[Any, Any]:
    """The config (read as the 4.4x code expects) and the model class of the checkpoint in
    ``folder`` (``kind``: ``evabyte`` | ``llama3_byte``), imported with triton blocked."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    install_removed_module_shims()
    with remote_imports(OPTIONAL_PACKAGES[kind], frozenset({"triton"})):
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        class_ref = hf_config.auto_map["AutoModelForCausalLM"]
        cls = get_class_from_dynamic_module(class_ref, folder)
    patch_remote_config(hf_config, kind)
    return hf_config, cls


def write_checkpoint(
    kind: str, code: Path, rope: str, root: Path, **overrides: Any
) -> tuple[Path, Any]:
    """A hub-style tiny random checkpoint of the real code; returns it and the direct model.

    ``overrides`` replace config fields (``num_hidden_layers``, ``chunk_size``, ...)."""
    folder = root / f"{kind}_{rope}_{uuid.uuid4().hex[:8]}"  # unique remote module name
    folder.mkdir(parents=True)
    for source in code.glob("*.py"):
        if source.name != "__init__.py" and "flax" not in source.name:
            shutil.copy(source, folder / source.name)
    config = dict(EVABYTE_CONFIG if kind == "evabyte" else LLAMA3_BYTE_CONFIG)
    config["rope_scaling"] = ROPE_SCALING[rope]
    config.update(overrides)
    if kind == "llama3_byte":
        config["expand_input_ids_dict"] = expand_table(config["vocab_size"], 40)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    hf_config, cls = remote_class(folder, kind)
    patch_remote_module(sys.modules[cls.__module__])
    torch.manual_seed(0)
    direct = cls(hf_config).eval()
    with torch.no_grad():
        for name, p in direct.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
            elif "norm" not in name:
                p.normal_(0, 0.1)
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in direct.state_dict().items()}, folder / "model.safetensors"
    )
    return folder, direct


def own_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's own full forward: STP logits (B, T, V)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[..., : model.config.vocab_size].float()


def own_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """The model's own greedy decoding: argmax of its full forward, one id at a time."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(own_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def one_pass_report(backbone: Any, direct: Any, vocab: int) -> dict[str, float]:
    """Check 6: one cached pass vs one position per pass vs the model's own forward."""
    torch.manual_seed(2)
    ids = torch.randint(3, vocab, (1, 40))
    own = own_logits(direct, ids)[0]  # (40, V)
    layers = backbone.num_layers
    cache = backbone.new_cache(0, layers)

    def logits(chunk: torch.Tensor, into: Any) -> torch.Tensor:
        hidden = backbone.run_layers(backbone.embed(chunk), 0, layers, cache=into)
        return backbone.stp_logits(backbone.norm(hidden))[0].float()

    with torch.no_grad():
        logits(ids[:, :21], cache)
        w = backbone.one_pass_span(21, 16)  # to the window boundary
        sequential = cache.clone()
        one = logits(ids[:, 21 : 21 + w], cache)
        seq = torch.cat([logits(ids[:, i : i + 1], sequential) for i in range(21, 21 + w)])
        after = logits(ids[:, 21 + w : 21 + w + 3], cache)  # past the boundary: RFAs of the window
    return {
        "window": float(w),
        "one_pass_vs_sequential": float((one - seq).abs().max()),
        "one_pass_vs_own_forward": float((one - own[21 : 21 + w]).abs().max()),
        "next_window_vs_own_forward": float((after - own[21 + w : 24 + w]).abs().max()),
    }


def load_eva_triton_attention(code: Path) -> Any:
    """The real ``eva.py`` (the triton path's attention) with its kernel modules stubbed."""
    package = f"eva_triton_check_{uuid.uuid4().hex[:8]}"
    stubs = {package: types.ModuleType(package)}
    stubs[package].__path__ = []  # type: ignore[attr-defined]
    for kernel, function in (("eva_agg_kernel", "eva_agg_func_triton"),
                             ("eva_prep_kv_kernel", "eva_prep_kv_func_triton")):  # fmt: skip
        stubs[f"{package}.{kernel}"] = types.ModuleType(kernel)
        setattr(stubs[f"{package}.{kernel}"], function, None)  # never called by the check
    if "triton" not in sys.modules:
        stubs["triton"] = types.ModuleType("triton")  # eva.py only imports it
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(f"{package}.eva", code / "eva.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module.EvaAttention


def triton_contract_report(backbone: Any, code: Path, vocab: int) -> dict[str, float]:
    """Check 8: the real triton-path multibyte forward against ours, on the same state."""
    from mtpc.backbones.evabyte import multibyte_attention, multibyte_mask

    mine = backbone.layers[0].self_attn
    real = load_eva_triton_attention(code)(backbone.config, layer_idx=0)
    real.load_state_dict(mine.state_dict())
    torch.manual_seed(3)
    layers = backbone.num_layers
    cache = backbone.new_cache(0, layers)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        backbone.run_layers(
            backbone.embed(torch.randint(3, vocab, (1, 37))), 0, layers, cache=cache
        )
        backbone._settle(cache.native)  # 37 = 2 windows (8 RFAs) + 5 kept
        hidden = torch.randn(1, 4, backbone.hidden_size)
        positions = 37 + torch.tensor([[0, 1, 1, 2]])
        cos, sin = backbone._rotary(hidden, positions)
        mask = multibyte_mask(cache.native, 1, tree, hidden.device)
        states = {"real": cache.native, "ours": copy.deepcopy(cache.native)}
        out_real = real._multibyte_decoding_forward(
            hidden, attention_mask=mask, position_ids=positions,
            past_key_value=states["real"], use_cache=True, cos=cos, sin=sin,
        )[0]  # fmt: skip
        out_ours = multibyte_attention(
            mine, hidden, attention_mask=mask, position_ids=positions,
            past_key_value=states["ours"], use_cache=True, cos=cos, sin=sin,
            multibyte_decoding=True,
        )[0]  # fmt: skip
    k_real, k_ours = states["real"].past_window_k[0], states["ours"].past_window_k[0]
    return {
        "rfa_chunks": float(cache.native.chunks()),
        "output_max_abs_diff": float((out_real - out_ours).abs().max()),
        "written_keys_max_abs_diff": float((k_real - k_ours).abs().max()),
    }


def check(kind: str, code: Path, rope: str, steps: int) -> dict[str, Any]:
    """Runs checks 1-5; returns the report (``ok`` is their conjunction)."""
    report: dict[str, Any] = {"kind": kind, "code": str(code), "rope_scaling": rope}
    with tempfile.TemporaryDirectory() as tmp:
        folder, direct = write_checkpoint(kind, code, rope, Path(tmp))
        backbone = load_backbone(
            kind, path=str(folder), dtype="float32", device="cpu", attention_impl="torch"
        )
        report["1_loaded_and_sanity_checked"] = True
        mine, theirs = non_persistent_buffers(backbone.hf_model), non_persistent_buffers(direct)
        report["2_buffers"] = {
            name: float((mine[name].float() - t.float()).abs().max()) for name, t in theirs.items()
        }
        vocab = backbone.vocab_size
        torch.manual_seed(1)
        ids = torch.randint(3, vocab, (2, 37))
        ref = own_logits(direct, ids)
        report["3_forward_max_abs_diff"] = float(
            (own_logits(backbone.hf_model, ids) - ref).abs().max()
        )
        with torch.no_grad():
            split = backbone.stp_logits(
                backbone.norm(backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers))
            ).float()
        report["4_split_max_abs_diff"] = float((split - ref).abs().max())
        if kind == "evabyte":
            report["6_one_pass"] = one_pass_report(backbone, direct, vocab)
            report["8_triton_multibyte_forward"] = triton_contract_report(backbone, code, vocab)
            wide = MTPCModel.from_backbone(
                load_backbone(kind, path=str(folder), dtype="float32", device="cpu",
                              attention_impl="torch"),
                "cp", 16, 2, lora_layers=1,
            )  # fmt: skip
        model = MTPCModel.from_backbone(backbone, "cp", 4, 2, lora_layers=1)
        with torch.no_grad():
            for p in model.backbone.lora.parameters():
                p.normal_(0, 0.05)
        lengths = [1, 3, 4, 5, 15, 16, 17, 31, 33]
        greedy: dict[str, Any] = {}
        for length in lengths:
            prompt = torch.randint(3, vocab, (length,)).tolist()
            want = own_greedy(direct, prompt, steps)
            got = {
                method: generate(
                    model, prompt, max_new_tokens=steps, method=method, greedy=True, stop_ids=()
                ).tokens
                for method in ("speculative", "autoregressive")
            }
            if kind == "evabyte":
                got["speculative_n16"] = generate(
                    wide, prompt, max_new_tokens=steps, greedy=True, stop_ids=()
                ).tokens
            greedy[str(length)] = {m: list(t) == want for m, t in got.items()}
        report["5_greedy_equal"] = greedy
    report["ok"] = (
        all(v == 0.0 for v in report["2_buffers"].values())
        and report["3_forward_max_abs_diff"] <= 1e-5
        and report["4_split_max_abs_diff"] <= 1e-4
        and all(all(v.values()) for v in greedy.values())
        and all(
            v <= 1e-4
            for key in ("6_one_pass", "8_triton_multibyte_forward")
            for name, v in report.get(key, {}).items()
            if "diff" in name or "_vs_" in name
        )
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("evabyte", "llama3_byte"))
    parser.add_argument("code", type=Path, help="directory holding the real remote *.py")
    parser.add_argument(
        "--rope",
        choices=sorted(ROPE_SCALING),
        default=None,
        help="rope_scaling of the tiny config (default: the real checkpoint's: "
        "evabyte -> default (null), llama3_byte -> llama3)",
    )
    parser.add_argument("--steps", type=int, default=24, help="new ids per greedy comparison")
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="only write the tiny checkpoint to this directory (no checks)",
    )
    parser.add_argument("--window-size", type=int, default=None, help="EvaByte's EVA window")
    parser.add_argument("--chunk-size", type=int, default=None, help="EvaByte's EVA chunk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rope = args.rope or ("default" if args.kind == "evabyte" else "llama3")
    if args.save is not None:
        sizes = {"window_size": args.window_size, "chunk_size": args.chunk_size}
        overrides = {k: v for k, v in sizes.items() if v is not None}
        if overrides and args.kind != "evabyte":
            parser.error("--window-size / --chunk-size are EvaByte's (kind evabyte)")
        if args.kind == "evabyte":  # room for rows past a window of the largest size asked
            overrides["max_position_embeddings"] = 4 * max(overrides.get("window_size", 16), 128)
        if args.save.exists():
            parser.error(f"--save {args.save} exists; allowed: a path that does not exist yet")
        with tempfile.TemporaryDirectory() as tmp:
            folder, _ = write_checkpoint(
                args.kind, args.code.resolve(), rope, Path(tmp), **overrides
            )
            shutil.copytree(folder, args.save)
        print(f"wrote {args.save}")
        return 0
    report = check(args.kind, args.code.resolve(), rope, args.steps)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
