"""Hub-style checkpoints of EvaByte-like and byte-Llama-like models with remote code.

``eva_checkpoint`` / ``llama_checkpoint`` write, into a fresh folder under ``tmp_path``,
``config.json`` in the transformers 4.4x form with ``auto_map``, a remote package of our own
writing (never third-party code) built on the stand-ins of ``tests/fakes.py``, and
``model.safetensors``; they return the folder and the stand-in holding the same weights. The
remote code reproduces what breaks the real EvaByte / byte-Llama code under transformers 5
(see ``tests/test_backbone_loading.py``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

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

EVA_AGG_KERNEL = '''
"""Our stand-in for EvaByte's eva_agg_kernel.py (same host-wrapper interface and failure modes).

The host wrappers assert ``is_cuda`` and pick their blocks by
``torch.cuda.get_device_capability()``; the backward asserts on ``rfa_k.stride(-1)`` even when
``rfa_k`` is None; the kernel gives each program the rows of one window only, so a BLOCK_M
larger than the window is silently wrong. The "attention" is a windowed causal mean of v:
o[t] = mean of v[s] for s in t's window (aligned at 0) with s <= t.
"""
import torch
import triton
import triton.language as tl


def _get_config(dtype, head_dim, mode):
    capability = torch.cuda.get_device_capability()
    if capability >= (9, 0):
        return (16, 2, 4, 1)
    return (8, 2, 4, 1)


@triton.jit
def _fwd_window_mean_kernel(V, O, stride_vb, stride_vt, seqlen, HEADDIM: tl.constexpr,
                            WINDOW_SIZE: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEADDIM)
    offs_w = (start_m * BLOCK_M) // WINDOW_SIZE  # one window per program, as EVA's kernels
    start_n = offs_w * WINDOW_SIZE
    end_n = tl.minimum((start_m + 1) * BLOCK_M, seqlen)
    acc = tl.zeros([BLOCK_M, HEADDIM], dtype=tl.float32)
    for n in range(start_n, end_n):
        v = tl.load(V + off_bh * stride_vb + n * stride_vt + offs_d)
        acc += tl.where((offs_m >= n)[:, None], v[None, :], 0.0)
    count = (offs_m - start_n + 1).to(tl.float32)
    out = acc / count[:, None]
    tl.store(O + off_bh * stride_vb + offs_m[:, None] * stride_vt + offs_d[None, :], out,
             mask=(offs_m < seqlen)[:, None])


def triton_eva_agg_fwd(q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale,
                       window_size, chunks_per_window):
    assert q.is_cuda and k.is_cuda and v.is_cuda
    batch, nheads, seqlen, head_dim = v.shape
    BLOCK_M, BLOCK_N, num_warps, num_stages = _get_config(q.dtype, head_dim, "fwd")
    assert chunks_per_window >= BLOCK_N, "chunks_per_window must be greater than BLOCK"
    v = v.contiguous().reshape(batch * nheads, seqlen, head_dim)
    o = torch.empty_like(v)
    grid = (triton.cdiv(seqlen, BLOCK_M), batch * nheads)
    _fwd_window_mean_kernel[grid](v, o, v.stride(0), v.stride(1), seqlen, head_dim,
                                  window_size, BLOCK_M)
    lse = torch.zeros(batch, nheads, seqlen, dtype=torch.float32, device=v.device)
    return o.reshape(batch, nheads, seqlen, head_dim), lse


def triton_eva_agg_bwd(do, q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, o, lse, dq, dk, dv,
                       d_rfa_k, d_rfa_v, softmax_scale, window_size, chunks_per_window,
                       empty_rfa_kv, mask_type):
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == o.stride(-1) == rfa_k.stride(-1) == rfa_v.stride(-1) == 1
    assert q.is_cuda
    _get_config(q.dtype, q.shape[-1], "bwd_dq")
    seqlen = v.shape[-2]
    t = torch.arange(seqlen, device=v.device)
    count = (t % window_size + 1).to(do.dtype)
    g = do / count[:, None]  # d o[t] / d v[s] = 1 / count[t] for s in t's window, s <= t
    start = t - t % window_size
    weight = ((t[None, :] >= t[:, None]) & (start[None, :] == start[:, None])).to(do.dtype)
    dv.copy_(weight @ g)  # (T, T) @ (B, h, T, hd)
    dq.zero_()
    dk.zero_()


class EvaAggFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale=None,
                window_size=None, chunks_per_window=None):
        empty_rfa_kv = 1 if rfa_k is None and rfa_v is None else 0
        o, lse = triton_eva_agg_fwd(q, k, v, rfa_k, rfa_v, window_mask, chunk_mask,
                                    softmax_scale, window_size, chunks_per_window)
        ctx.save_for_backward(q, k, v, o, lse, rfa_k, rfa_v, window_mask, chunk_mask)
        ctx.softmax_scale, ctx.window_size = softmax_scale, window_size
        ctx.chunks_per_window, ctx.empty_rfa_kv = chunks_per_window, empty_rfa_kv
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, rfa_k, rfa_v, window_mask, chunk_mask = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_rfa_k = d_rfa_v = None
        triton_eva_agg_bwd(do, q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, o, lse,
                           dq, dk, dv, d_rfa_k, d_rfa_v, softmax_scale=ctx.softmax_scale,
                           window_size=ctx.window_size, chunks_per_window=ctx.chunks_per_window,
                           empty_rfa_kv=ctx.empty_rfa_kv, mask_type=0)
        return dq, dk, dv, None, None, None, None, None, None, None


def eva_agg_func_triton(q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale=None,
                        window_size=None, chunks_per_window=None):
    return EvaAggFunc.apply(q, k, v, rfa_k, rfa_v, window_mask, chunk_mask, softmax_scale,
                            window_size, chunks_per_window)
'''

EVA_PREP_KV_KERNEL = '''
"""Our stand-in for EvaByte's eva_prep_kv_kernel.py: chunk means of k and v (host code only)."""
import torch
import triton  # noqa: F401  (unconditional, like EvaByte's)


def triton_eva_prep_kv_fwd(k, v, param_mu, param_phi, mask, softmax_scale, chunksize):
    assert k.is_cuda and v.is_cuda
    b, h, t, d = k.shape
    return (k.reshape(b, h, t // chunksize, chunksize, d).mean(-2),
            v.reshape(b, h, t // chunksize, chunksize, d).mean(-2))


def triton_eva_prep_kv_bwd(d_rfa_k, d_rfa_v, k, v, param_mu, param_phi, mask, rfa_k, rfa_v,
                           d_k, d_v, d_param_mu, d_param_phi, softmax_scale, mask_type,
                           chunksize):
    assert k.is_cuda
    raise NotImplementedError


def eva_prep_kv_func_triton(k, v, param_mu, param_phi, mask, softmax_scale=None, chunksize=None):
    return triton_eva_prep_kv_fwd(k, v, param_mu, param_phi, mask, softmax_scale, chunksize)
'''

EVA_MODELING = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from tests.fakes import EvaCache, FakeEvaByteModel
from .configuration_fixture_eva import FixtureEvaConfig
from .eva_agg_kernel import eva_agg_func_triton  # needs triton, used on GPUs only
from .eva_prep_kv_kernel import triton_eva_prep_kv_fwd  # noqa: F401

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


def eva_checkpoint(
    tmp_path: Path, rope_scaling: dict[str, Any] | None, window_size: int | None = None
) -> tuple[Path, Any]:
    """An EvaByte-like checkpoint and the stand-in whose weights it holds (EVA window 16, or
    ``window_size`` in its config.json; the stand-in's attention does not read it).

    Its kernel modules ``eva_agg_kernel.py`` / ``eva_prep_kv_kernel.py`` are ours, with the
    host-wrapper interface of EvaByte's and their failure modes (``EVA_AGG_KERNEL``): what
    ``mtpc.backbones.evabyte_kernels.prepare_eva_kernels`` wraps, run under triton's interpreter by
    ``tests/test_triton_interpreter.py``. The model itself never calls them."""
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
        **({"window_size": window_size} if window_size is not None else {}),
    }
    files = {
        "configuration_fixture_eva.py": EVA_CONFIGURATION,
        "eva_agg_kernel.py": EVA_AGG_KERNEL,
        "eva_prep_kv_kernel.py": EVA_PREP_KV_KERNEL,
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


def stand_in_triton(tmp_path: Path, monkeypatch: Any) -> None:
    """Makes ``import triton`` find a stand-in package (``jit`` a no-op; no kernel runs).

    A real triton already imported is taken out of ``sys.modules`` for the test and put back
    at its teardown: importing triton's extension (``triton._C.libtriton``) a second time in
    one process aborts it, so the real modules must never be dropped for good."""
    import sys

    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    site = tmp_path / "site"
    (site / "triton").mkdir(parents=True)
    (site / "triton" / "__init__.py").write_text("def jit(fn=None, **kw):\n    return fn\n")
    (site / "triton" / "language.py").write_text("constexpr = int\n")
    monkeypatch.syspath_prepend(str(site))
