"""Loading trust_remote_code checkpoints through ``load_backbone`` gives the real model.

Each test writes its own hub-style checkpoint into ``tmp_path``: ``config.json`` in the
transformers 4.4x form with ``auto_map``, a remote package of our own writing (never
third-party code) built on the stand-ins of ``tests/fakes.py``, and ``model.safetensors``.
The remote code reproduces what breaks the real EvaByte / byte-Llama code under transformers
5: rotary tables registered as non-persistent buffers in ``__init__`` (left uninitialised by
meta-device loading), ``rope_scaling`` read in its old form (``["type"]``, ``["factor"]``),
``ROPE_INIT_FUNCTIONS["default"]``, a kernel module importing ``triton`` at import time, and
config keys the config class does not define. Loading must give logits identical to the
directly built model (the same class built on CPU with the same weights), rotary tables
equal to their closed form, or a clear error.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from mtpc.backbones import TargetLoadError, load_backbone
from mtpc.backbones import compat as compat_module
from mtpc.backbones.sanity import rotary_problems
from tests.fakes import FakeEvaByteConfig, FakeEvaByteForCausalLM, FakeTPULlamaForCausalLM

# --------------------------------------------------------------- remote code (ours) ----
EVA_CONFIGURATION = '''
from transformers import PretrainedConfig


class FixtureEvaConfig(PretrainedConfig):
    """Like EvaByteConfig: defines neither num_pred_heads nor fp32_skip_add / fp32_logits."""

    model_type = "evabyte"

    def __init__(self, vocab_size=320, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=96, rope_theta=10000.0,
                 rope_scaling=None, window_size=16, chunk_size=4, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.window_size = window_size
        self.chunk_size = chunk_size
        super().__init__(**kwargs)
'''

EVA_KERNELS = """
import triton  # unconditional, like EvaByte's eva_prep_kv_kernel.py
import triton.language as tl


@triton.jit
def fused_attention_kernel(x, BLOCK: tl.constexpr):
    pass
"""

EVA_MODELING = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from tests.fakes import EvaCache, FakeEvaByteModel
from .configuration_fixture_eva import FixtureEvaConfig
from .fixture_eva_kernels import fused_attention_kernel  # needs triton, used on GPUs only

try:
    import triton  # noqa: F401

    USE_TRITON_IMPL = True
except ImportError:
    USE_TRITON_IMPL = False


class FixtureEvaRotary(nn.Module):
    """EvaByte's layout: inv_freq, cos_cached, sin_cached, all non-persistent, from __init__."""

    def __init__(self, dim, max_position_embeddings, base, scaling_factor=1.0):
        super().__init__()
        self.dim, self.base, self.scaling_factor = dim, base, scaling_factor
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base ** exponents), persistent=False)
        t = torch.arange(max_position_embeddings, dtype=torch.float32) / scaling_factor
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(torch.get_default_dtype()), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(torch.get_default_dtype()), persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


class FixtureEvaLinearScalingRotary(FixtureEvaRotary):
    pass


class FixtureEvaModel(FakeEvaByteModel):
    def __init__(self, config):
        super().__init__(config)
        self.skip_add_in_fp32 = config.fp32_skip_add  # a key the config class lacks
        dim = config.hidden_size // config.num_attention_heads
        if config.rope_scaling is None:  # EvaByte's _init_rope
            self.rotary_emb = FixtureEvaRotary(dim, config.max_position_embeddings, config.rope_theta)
        elif config.rope_scaling["type"] == "linear":
            self.rotary_emb = FixtureEvaLinearScalingRotary(
                dim, config.max_position_embeddings, config.rope_theta,
                scaling_factor=config.rope_scaling["factor"],
            )
        else:
            raise ValueError(config.rope_scaling)


class FixtureEvaForCausalLM(PreTrainedModel):
    config_class = FixtureEvaConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = FixtureEvaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size * config.num_pred_heads, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)

    def forward(self, input_ids=None, use_cache=None, **kwargs):
        hidden, cache = self.model(input_ids)
        logits = self.lm_head(hidden)[..., : self.config.vocab_size]
        if self.config.fp32_logits:  # a key the config class lacks
            logits = logits.float()
        return CausalLMOutputWithPast(logits=logits)
'''

LLAMA_CONFIGURATION = """
from transformers import LlamaConfig


class FixtureByteLlamaConfig(LlamaConfig):
    model_type = "tpu_llama"

    def __init__(self, expand_input_ids=False, expand_input_ids_maxlen=None,
                 expand_input_ids_vocab_size=None, expand_input_ids_dict=None, **kwargs):
        self.expand_input_ids = expand_input_ids
        self.expand_input_ids_maxlen = expand_input_ids_maxlen
        self.expand_input_ids_vocab_size = expand_input_ids_vocab_size
        self.expand_input_ids_dict = expand_input_ids_dict
        super().__init__(**kwargs)
"""

LLAMA_MODELING = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.fakes import FakeTPULlamaModel, torch_expand_input_ids  # noqa: F401
from .configuration_fixture_llama import FixtureByteLlamaConfig
{extra_import}


class FixtureRotary(nn.Module):
    """tokenkit's layout: the rope type from rope_scaling, inv_freq from ROPE_INIT_FUNCTIONS."""

    def __init__(self, config):
        super().__init__()
        if config.rope_scaling is not None:
            self.rope_type = config.rope_scaling.get("rope_type", config.rope_scaling.get("type"))
        else:
            self.rope_type = "default"
        self.config = config
        self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = self.rope_init_fn(config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class FixtureByteLlamaModel(FakeTPULlamaModel):
    def __init__(self, config):
        super().__init__(config)
        table, singles = config.expand_input_ids_dict  # tokenkit's serialised form
        self.expand_input_ids_dict = (
            {{tuple(int(n) for n in k.split(",")): v for k, v in table.items()}},
            set(int(n) for n in singles),
        )
        self.rotary_emb = FixtureRotary(config)


class FixtureByteLlamaForCausalLM(PreTrainedModel):
    config_class = FixtureByteLlamaConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = FixtureByteLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)

    def forward(self, input_ids=None, use_cache=None, past_input_ids=None, **kwargs):
        hidden = self.model(input_ids, past_input_ids=past_input_ids)
        return CausalLMOutputWithPast(logits=self.lm_head(hidden))
'''

ABSENT_PACKAGE = "mtpc_test_absent_package"
OLD_FORM_ROPE = [None, {"type": "linear", "factor": 2.0}]


# ------------------------------------------------------------------- checkpoints ----
def _write(folder: Path, files: dict[str, str], config: dict[str, Any], weights: Any) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().contiguous() for k, v in weights.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _unique(tmp_path: Path, stem: str) -> Path:
    """A checkpoint folder whose name (hence remote module name) no other test uses."""
    return tmp_path / f"{stem}_{uuid.uuid4().hex[:10]}"


def eva_checkpoint(tmp_path: Path, rope_scaling: dict[str, Any] | None) -> tuple[Path, Any]:
    """An EvaByte-like checkpoint and the stand-in whose weights it holds."""
    config = FakeEvaByteConfig(hidden_size=32, num_hidden_layers=2, chunk_size=4)  # the fixture's
    fake = FakeEvaByteForCausalLM(config).eval()
    with torch.no_grad():
        for p in fake.parameters():
            p.normal_(0, 0.3)
    config = {
        "architectures": ["FixtureEvaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_fixture_eva.FixtureEvaConfig",
            "AutoModelForCausalLM": "modeling_fixture_eva.FixtureEvaForCausalLM",
        },
        "model_type": "evabyte",
        "vocab_size": 320,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 96,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "num_pred_heads": 8,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    files = {
        "configuration_fixture_eva.py": EVA_CONFIGURATION,
        "fixture_eva_kernels.py": EVA_KERNELS,
        "modeling_fixture_eva.py": EVA_MODELING,
    }
    return _write(_unique(tmp_path, "eva"), files, config, fake), fake


def llama_checkpoint(
    tmp_path: Path, rope_scaling: dict[str, Any] | None, extra_import: str = ""
) -> tuple[Path, Any]:
    """A byte-Llama-like checkpoint (tokenkit's layout) and the stand-in holding its weights."""
    vocab, expand_vocab = 272, 23
    table = {(a,): a % expand_vocab + 1 for a in range(1, vocab + 1)}
    table.update(
        {(a, b): (7 * a + 3 * b) % expand_vocab + 1 for a in range(1, 30) for b in range(1, 30)}
    )
    singles = {a for a in range(1, vocab + 1) if a % 5 == 0}
    sizes = {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rope_theta": 10000.0,
    }  # fmt: skip
    fake_config = LlamaConfig(**sizes)
    fake_config._attn_implementation = "eager"
    fake_config.expand_input_ids, fake_config.expand_input_ids_maxlen = True, 3
    fake_config.expand_input_ids_vocab_size = expand_vocab
    fake_config.expand_input_ids_dict = (table, singles)
    fake = FakeTPULlamaForCausalLM(fake_config).eval()
    with torch.no_grad():
        for name, p in fake.named_parameters():
            p.normal_(0, 0.3) if "norm" not in name else p.uniform_(0.5, 1.5)
    config = {
        **sizes,
        "architectures": ["FixtureByteLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_fixture_llama.FixtureByteLlamaConfig",
            "AutoModelForCausalLM": "modeling_fixture_llama.FixtureByteLlamaForCausalLM",
        },
        "model_type": "tpu_llama",
        "rope_scaling": rope_scaling,
        "attn_implementation": "eager",
        "torch_dtype": "float32",
        "expand_input_ids": True,
        "expand_input_ids_maxlen": 3,
        "expand_input_ids_vocab_size": expand_vocab,
        "expand_input_ids_dict": [
            {",".join(map(str, k)): v for k, v in table.items()},
            sorted(singles),
        ],
    }
    files = {
        "configuration_fixture_llama.py": LLAMA_CONFIGURATION,
        "modeling_fixture_llama.py": LLAMA_MODELING.format(extra_import=extra_import),
    }
    if extra_import:
        files["fixture_helpers.py"] = f"import {ABSENT_PACKAGE}\n"
    return _write(_unique(tmp_path, "llama"), files, config, fake), fake


def direct_build(loaded: Any, folder: Path) -> Any:
    """The loaded model's class built directly on CPU (buffers computed by its own __init__)
    from the same config, with the checkpoint's weights."""
    from safetensors.torch import load_file

    model = type(loaded)(loaded.config).eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[..., : model.config.vocab_size]


def split_logits(backbone: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits through the backbone's split path (what training and decoding use)."""
    with torch.no_grad():
        hidden = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)
        return backbone.stp_logits(backbone.norm(hidden))


def closed_form(dim: int, positions: int, factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))  # (dim / 2,)
    t = torch.arange(positions, dtype=torch.float32) / factor
    emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)  # (positions, dim)
    return inv_freq, emb.cos(), emb.sin()


# ------------------------------------------------------------------------- tests ----
@pytest.mark.parametrize("rope_scaling", OLD_FORM_ROPE, ids=["rope_null", "rope_linear_old_form"])
def test_evabyte_checkpoint_loads_the_real_model_without_triton(
    tmp_path: Path, rope_scaling: dict[str, Any] | None
) -> None:
    folder, fake = eva_checkpoint(tmp_path, rope_scaling)
    backbone = load_backbone("evabyte", path=str(folder), dtype="float32", device="cpu")
    hf = backbone.hf_model
    # the rotary tables are the closed form (not meta-device garbage)
    factor = rope_scaling["factor"] if rope_scaling else 1.0
    want = closed_form(8, 96, factor)
    rotary = hf.model.rotary_emb
    for got, expected in zip(
        (rotary.inv_freq, rotary.cos_cached, rotary.sin_cached), want, strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # logits: the loaded model's forward and the split path equal the directly built model's
    ids = torch.randint(3, 320, (2, 21))
    ref = logits_of(direct_build(hf, folder), ids)
    torch.testing.assert_close(logits_of(hf, ids), ref, rtol=0, atol=0)
    torch.testing.assert_close(split_logits(backbone, ids), ref, rtol=0, atol=1e-5)
    if rope_scaling is None:  # plain RoPE: also the stand-in's own logits (independent of compat)
        torch.testing.assert_close(ref, logits_of(fake, ids), rtol=0, atol=1e-5)
    # config keys the class lacks: the checkpoint's value kept, the rest defaulted
    assert hf.config.num_pred_heads == 8 and hf.config.fp32_skip_add is False
    assert backbone.mtp_unembeddings().shape == (8, 320, 32)
    # no triton here: the pure-torch path, the kernel module a placeholder that says why
    remote = sys.modules[type(backbone.inner).__module__]
    assert remote.USE_TRITON_IMPL is False and backbone.use_triton is False
    kernels = sys.modules[remote.__name__.rpartition(".")[0] + ".fixture_eva_kernels"]
    with pytest.raises(RuntimeError, match="triton"):
        kernels.fused_attention_kernel()


@pytest.mark.parametrize("rope_scaling", OLD_FORM_ROPE, ids=["rope_null", "rope_linear_old_form"])
def test_byte_llama_checkpoint_loads_the_real_model(
    tmp_path: Path, rope_scaling: dict[str, Any] | None
) -> None:
    folder, fake = llama_checkpoint(tmp_path, rope_scaling)
    backbone = load_backbone("llama3_byte", path=str(folder), dtype="float32", device="cpu")
    hf = backbone.hf_model
    factor = rope_scaling["factor"] if rope_scaling else 1.0
    inv_freq = closed_form(8, 1)[0] / factor  # linear scaling divides the frequencies
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(hf.model.rotary_emb.original_inv_freq, inv_freq, rtol=1e-6, atol=0)
    ids = torch.randint(0, 272, (2, 19))
    ref = logits_of(direct_build(hf, folder), ids)
    torch.testing.assert_close(logits_of(hf, ids), ref, rtol=0, atol=0)
    torch.testing.assert_close(split_logits(backbone, ids), ref, rtol=0, atol=1e-5)
    if rope_scaling is None:
        torch.testing.assert_close(ref, logits_of(fake, ids), rtol=0, atol=1e-5)


def test_remote_code_importing_a_missing_package_is_a_clear_error(tmp_path: Path) -> None:
    folder, _ = llama_checkpoint(tmp_path, None, extra_import="from .fixture_helpers import *")
    with pytest.raises(
        TargetLoadError, match=rf"model=llama3_byte .*{ABSENT_PACKAGE}.*not installed"
    ):
        load_backbone("llama3_byte", path=str(folder), dtype="float32")


def test_uninitialised_rotary_buffers_fail_the_load_time_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the buffer rebuild, the sanity check names the model and the garbage table."""
    folder, _ = eva_checkpoint(tmp_path, None)

    def garble(model: Any, dtype: torch.dtype) -> list[str]:
        model.model.rotary_emb.inv_freq.fill_(-4.9e10)  # what transformers 5 leaves behind
        return []

    monkeypatch.setattr(compat_module, "restore_non_persistent_buffers", garble)
    with pytest.raises(TargetLoadError, match=r"model=evabyte .*rotary_emb\.inv_freq differs"):
        load_backbone("evabyte", path=str(folder), dtype="float32")


def test_rotary_check_accepts_closed_form_and_flags_cos_tables(tmp_path: Path) -> None:
    folder, _ = eva_checkpoint(tmp_path, {"type": "linear", "factor": 2.0})
    hf = load_backbone("evabyte", path=str(folder), dtype="float32").hf_model
    assert rotary_problems(hf) == []
    hf.model.rotary_emb.cos_cached.zero_()
    assert any("cos_cached differs" in p for p in rotary_problems(hf))


def test_attention_path_is_chosen_checked_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="attention_impl is 'flash'; allowed"):
        load_backbone("evabyte", path="/nonexistent", dtype="float32", attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl is 'triton'"):  # no triton / no GPU
        load_backbone("evabyte", path="/nonexistent", dtype="float32", attention_impl="triton")
    assert compat_module.resolve_attention_impl("auto", "cpu") == "torch"
    folder, _ = eva_checkpoint(tmp_path, None)
    with caplog.at_level(logging.INFO, logger="mtpc.backbones.compat"):
        backbone = load_backbone(
            "evabyte", path=str(folder), dtype="float32", attention_impl="torch"
        )
    assert backbone.use_triton is False
    assert "EVA attention path 'torch'" in caplog.text


def test_attention_impl_is_a_validated_model_field() -> None:
    from hydra import compose, initialize_config_dir

    from mtpc.config import ConfigError, validate_train_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=evabyte"])
        assert cfg.model.attention_impl == "auto"
        validate_train_config(cfg)
        bad = compose(
            config_name="train", overrides=["model=evabyte", "model.attention_impl=flash"]
        )
    with pytest.raises(
        ConfigError, match=r"model\.attention_impl='flash' is not allowed; allowed: auto"
    ):
        validate_train_config(bad)


def test_attention_path_switch_imports_the_remote_code_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EvaByte picks its path at import time: a load with the other path re-imports it."""
    site = tmp_path / "site"  # a stand-in triton package (no kernels are ever run)
    (site / "triton").mkdir(parents=True)
    (site / "triton" / "__init__.py").write_text("def jit(fn=None, **kw):\n    return fn\n")
    (site / "triton" / "language.py").write_text("constexpr = int\n")
    monkeypatch.syspath_prepend(str(site))
    folder, _ = eva_checkpoint(tmp_path, None)
    paths = []
    try:
        for impl in ("torch", "triton", "torch"):
            monkeypatch.setattr(compat_module, "resolve_attention_impl", lambda *_, i=impl: i)
            model = compat_module.load_remote_causal_lm(
                "evabyte", str(folder), None, torch.float32, "cpu", impl
            )
            paths.append(sys.modules[type(model).__module__].USE_TRITON_IMPL)
    finally:
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]
    assert paths == [False, True, False]
