"""Small stand-ins with the interfaces of EvaByte's and the byte-level Llama's remote code.

``FakeEvaByteForCausalLM`` follows ``evabyte_hf/modeling_evabyte.py``: ``model.embed_tokens``,
``model.layers`` called as ``layer(h, attention_mask=<4-tuple>, position_ids, past_key_value,
output_attentions, use_cache, cos, sin, multibyte_decoding)`` returning a tuple,
``model.rotary_emb(x, seq_len) -> (cos, sin)`` of shape (seq_len, head_dim),
``model._prepare_eva_generation_attn_mask(...)``, ``lm_head = Linear(d, 8 * V)``, and this
module's ``USE_TRITON_IMPL``/``EvaCache``: per-layer lists grown by append, prefill detected by
``len(list) <= layer_idx``, tokens counted at layer 0 only. Its attention is EVA's, written
here densely (one mask over all singletons and all chunk RFAs, not EvaByte's incremental
window cache): position p attends the positions of its window (``window_size``, aligned at 0)
up to itself and one RFA per ``chunk_size`` chunk of every earlier window, with EvaByte's
``adaptive_mu_k``/``adaptive_phi`` parameters. It runs EVA's prefill only (the remote cache
from empty); decoding goes through ``mtpc.backbones.evabyte``'s one-pass path, which is then
checked against this full forward.

``FakeTPULlamaForCausalLM`` follows tokenkit's ``TPULlamaForCausalLM``: layers take
``past_key_value`` and return tuples, and the input embedding adds
``expand_embed_tokens(torch_expand_input_ids(history, ...))``, a function of the id history.

Below them, what several test modules share: tiny random targets (``make_target``,
``tiny_llama``), random drafts (``make_model``, ``randomize_lora``), the decoding prompts and
families, a stub drafter that knows the answer (``oracle``), and the exact-distribution checks
of sampling (``exact_distribution``, ``sampled_counts``, ``chi2_pvalue``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

if TYPE_CHECKING:  # mtpc is imported where used: the remote-code stand-ins need torch only
    from transformers import LlamaForCausalLM

    from mtpc.circuits.params import CircuitParams
    from mtpc.model import MTPCModel

USE_TRITON_IMPL = False


# ---------------------------------------------------------------------------- EvaByte ----
class FakeEvaByteConfig(PretrainedConfig):
    model_type = "evabyte"

    def __init__(
        self,
        vocab_size: int = 320,
        hidden_size: int = 32,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_pred_heads: int = 8,
        window_size: int = 16,
        chunk_size: int = 8,
        fp32_logits: bool = False,
        mixedp_attn: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_pred_heads = num_pred_heads
        self.window_size = window_size
        self.chunk_size = chunk_size
        self.fp32_logits = fp32_logits
        self.mixedp_attn = mixedp_attn
        super().__init__(**kwargs)


class EvaCache:
    """Same bookkeeping as evabyte_hf's EvaCache (lists per layer, count at layer 0)."""

    def __init__(self) -> None:
        self.w_k: list[Any] = []
        self.w_v: list[Any] = []
        self.rf_mask: list[Any] = []
        self._seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if len(self.w_k) <= layer_idx:
            return 0
        return self._seen_tokens

    def update_past_len(self, cur_q_len: int, layer_idx: int) -> int:
        if layer_idx == 0:
            self._seen_tokens += cur_q_len
        return self._seen_tokens

    def update_singletons(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int
    ) -> tuple[Any, Any, bool]:
        if len(self.w_k) <= layer_idx:  # prefill
            self.w_k.append(k)
            self.w_v.append(v)
            return k, v, True
        self.w_k[layer_idx] = torch.cat([self.w_k[layer_idx], k], dim=-2)
        self.w_v[layer_idx] = torch.cat([self.w_v[layer_idx], v], dim=-2)
        return self.w_k[layer_idx], self.w_v[layer_idx], False


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FakeEvaAttention(nn.Module):
    def __init__(self, config: FakeEvaByteConfig, layer_idx: int) -> None:
        super().__init__()
        d, h = config.hidden_size, config.num_attention_heads
        self.config, self.layer_idx, self.num_heads, self.head_dim = config, layer_idx, h, d // h
        self.head_dim_scaling = self.head_dim**-0.5
        self.window_size, self.chunk_size = config.window_size, config.chunk_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        shape = (1, h, 1, 1, self.head_dim)
        self.adaptive_phi = nn.Parameter(torch.randn(shape).clamp(-1, 1) * self.head_dim_scaling)
        self.adaptive_mu_k = nn.Parameter(torch.randn(shape).clamp(-1, 1) * self.head_dim_scaling)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cos=None, sin=None, multibyte_decoding=False):  # fmt: skip
        assert use_cache and past_key_value is not None, "EVA inference always runs with a cache"
        assert len(attention_mask) == 4, "EVA's cached path takes a 4-tuple of masks"
        assert past_key_value.get_seq_length(self.layer_idx) == 0, "the fake runs prefills only"
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        past_key_value.update_past_len(t, self.layer_idx)
        past_key_value.update_singletons(k, v, self.layer_idx)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        w, c, scale = self.window_size, self.chunk_size, self.head_dim_scaling
        n = t // c  # complete chunks
        kc = k[:, :, : n * c].reshape(b, self.num_heads, n, c, self.head_dim)
        vc = v[:, :, : n * c].reshape(b, self.num_heads, n, c, self.head_dim)
        mu = torch.softmax((self.adaptive_mu_k * kc).sum(-1), dim=-1)  # (B, h, n, c)
        log_phi = scale * ((self.adaptive_phi * kc).sum(-1) - 0.5 * (kc**2).sum(-1))
        rfa_k = (mu[..., None] * kc).sum(-2)  # (B, h, n, hd)
        rfa_v = (torch.softmax(log_phi, dim=-1)[..., None] * vc).sum(-2)
        p = torch.arange(t)
        window = p // w
        same = (window[:, None] == window[None, :]) & (p[None, :] <= p[:, None])  # (T, T)
        earlier = (torch.arange(n) * c // w)[None, :] < window[:, None]  # (T, n)
        allowed = torch.cat([same, earlier], dim=-1)
        keys, values = torch.cat([k, rfa_k], dim=-2), torch.cat([v, rfa_v], dim=-2)
        scores = (q @ keys.transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values  # (B, h, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None, past_key_value


class FakeEvaByteMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FakeEvaByteDecoderLayer(nn.Module):
    def __init__(self, config: FakeEvaByteConfig, layer_idx: int) -> None:
        super().__init__()
        d = config.hidden_size
        self.self_attn = FakeEvaAttention(config, layer_idx)
        self.mlp = FakeEvaByteMLP(d)
        self.input_layernorm = LlamaRMSNorm(d)
        self.post_attention_layernorm = LlamaRMSNorm(d)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cos=None, sin=None, multibyte_decoding=False):  # fmt: skip
        h, _, present = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, use_cache=use_cache, cos=cos, sin=sin,
            multibyte_decoding=multibyte_decoding,
        )  # fmt: skip
        hidden_states = hidden_states + h
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states, present) if use_cache else (hidden_states,)


class FakeEvaRotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False
        )

    def forward(
        self, x: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(int(seq_len or x.shape[-2]), dtype=torch.float32, device=x.device)
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)  # (S, hd)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class FakeEvaByteModel(nn.Module):
    def __init__(self, config: FakeEvaByteConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            FakeEvaByteDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size)
        self.rotary_emb = FakeEvaRotary(config.hidden_size // config.num_attention_heads)

    def _prepare_eva_generation_attn_mask(self, attention_mask, input_ids, use_cache, past_key_values):  # fmt: skip
        b, t = input_ids.shape
        if use_cache and past_key_values.get_seq_length() > 0:
            return (
                None,
                torch.zeros(b, 1, t, 1, dtype=torch.bool),
                torch.ones(b, 1, t, 1, dtype=torch.bool),
                None,
            )
        return (None, torch.ones(1, 1, t, t).triu(1).bool(), None, None)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, multibyte_decoding=None):  # fmt: skip
        b, t = input_ids.shape
        if past_key_values is None:
            past_key_values = EvaCache()
        masks = self._prepare_eva_generation_attn_mask(
            attention_mask, input_ids, True, past_key_values
        )
        past = past_key_values.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + t)[None].expand(b, t)
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden, seq_len=past + t)
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=masks, position_ids=position_ids, past_key_value=past_key_values,
                           output_attentions=False, use_cache=True, cos=cos, sin=sin,
                           multibyte_decoding=False)[0]  # fmt: skip
        return self.norm(hidden), past_key_values


class FakeEvaByteForCausalLM(nn.Module):
    def __init__(self, config: FakeEvaByteConfig) -> None:
        super().__init__()
        self.config = config
        self.model = FakeEvaByteModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size * config.num_pred_heads, bias=False
        )

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, return_all_pred_logits=None,
                multibyte_decoding=None):  # fmt: skip
        hidden, cache = self.model(
            input_ids, position_ids=position_ids, past_key_values=past_key_values
        )
        logits = self.lm_head(hidden).view(
            *hidden.shape[:2], self.config.num_pred_heads, self.vocab_size
        )
        return CausalLMOutputWithPast(logits=logits if return_all_pred_logits else logits[..., 0, :],
                                      past_key_values=cache)  # fmt: skip


def fake_evabyte(
    num_layers: int = 4,
    hidden_size: int = 32,
    vocab_size: int = 320,
    window_size: int = 16,
    chunk_size: int = 8,
) -> FakeEvaByteForCausalLM:
    """A random fake EvaByte in eval mode."""
    config = FakeEvaByteConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        window_size=window_size,
        chunk_size=chunk_size,
    )
    return FakeEvaByteForCausalLM(config).eval()


# ----------------------------------------------------------------------- byte Llama ----
def torch_expand_input_ids(input_ids, expand_input_ids_dict, maxlen, last_n=None):  # fmt: skip
    """tokenkit's rule: longest run of recent (id + 1)s, most recent first, in the table."""
    table, singles = expand_input_ids_dict
    out = torch.zeros_like(input_ids)
    for b in range(input_ids.shape[0]):
        recent: list[int] = []
        for i in range(input_ids.shape[1]):
            recent.insert(0, int(input_ids[b, i]) + 1)
            if len(recent) > maxlen:
                recent.pop()
            if last_n is not None and i < input_ids.shape[1] - last_n:
                continue
            if recent[0] in singles:
                out[b, i] = table[(recent[0],)] - 1
                continue
            n = len(recent)
            while n > 0 and tuple(recent[:n]) not in table:
                n -= 1
            if n:
                out[b, i] = table[tuple(recent[:n])] - 1
    return out


class FakeTPULlamaDecoderLayer(nn.Module):
    """The 4.4x layer interface (``past_key_value``, tuple output) over a Llama layer."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer = LlamaDecoderLayer(config, layer_idx)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None,
                position_embeddings=None, **kwargs):  # fmt: skip
        h = self.layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=past_key_value, position_embeddings=position_embeddings)  # fmt: skip
        return (h, past_key_value) if use_cache else (h,)


class FakeTPULlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.expand_embed_tokens = nn.Embedding(
            config.expand_input_ids_vocab_size, config.hidden_size
        )
        self.expand_input_ids_dict = config.expand_input_ids_dict
        self.layers = nn.ModuleList(
            FakeTPULlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache_position=None, past_input_ids=None):  # fmt: skip
        history = past_input_ids if past_input_ids is not None else input_ids
        t = input_ids.shape[1]
        expanded = torch_expand_input_ids(
            history, self.expand_input_ids_dict, self.config.expand_input_ids_maxlen, last_n=t
        )[:, -t:]
        hidden = self.embed_tokens(input_ids) + self.expand_embed_tokens(expanded)
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        pos = torch.arange(past, past + t)[None]
        mask = torch.full((t, past + t), torch.finfo(hidden.dtype).min).triu(past + 1)[None, None]
        cos_sin = self.rotary_emb(hidden, pos)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=pos, past_key_value=past_key_values,
                           use_cache=bool(use_cache), position_embeddings=cos_sin)[0]  # fmt: skip
        return self.norm(hidden)


class FakeTPULlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = FakeTPULlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, past_input_ids=None, **kwargs):  # fmt: skip
        hidden = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache,
                            past_input_ids=past_input_ids)  # fmt: skip
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=past_key_values)


def fake_llama3_byte(
    num_layers: int = 3, hidden_size: int = 32, vocab_size: int = 40
) -> FakeTPULlamaForCausalLM:
    """A random fake byte-level Llama whose expansion table holds every single id and pair."""
    expand_vocab = 23
    table: dict[tuple[int, ...], int] = {}
    for a in range(1, vocab_size + 1):
        table[(a,)] = a % expand_vocab + 1
        for b in range(1, vocab_size + 1):
            table[(a, b)] = (7 * a + 3 * b) % expand_vocab + 1
    singles = {a for a in range(1, vocab_size + 1) if a % 5 == 0}
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip
    config._attn_implementation = "eager"
    config.model_type = "tpu_llama"
    config.expand_input_ids = True
    config.expand_input_ids_maxlen = 4
    config.expand_input_ids_vocab_size = expand_vocab
    config.expand_input_ids_dict = (table, singles)
    return FakeTPULlamaForCausalLM(config).eval()


# ----------------------------------------------------- tiny-vocabulary targets and oracles ----
def make_target(vocab: int = 48, hidden: int = 32, seed: int = 0, context: int = 128):
    """A fresh 2-layer float64 Llama (fresh: LoRA is injected into the model it wraps)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4 if hidden >= 32 else 2, num_key_value_heads=2 if hidden >= 32 else 1,
        max_position_embeddings=context,
    )  # fmt: skip
    hf = LlamaForCausalLM(config).eval().to(torch.float64)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def exact_distribution(hf: nn.Module, prompt: list[int], length: int) -> torch.Tensor:
    """p(x_1..x_L | prompt) for all V^L continuations, in itertools.product order."""
    import itertools

    vocab = int(hf.config.vocab_size)
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (V^L, L)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.double(), -1)  # (V^L, P + L, V)
    P = len(prompt)
    steps = [logp[:, P - 1 + i].gather(1, seqs[:, i : i + 1])[:, 0] for i in range(length)]
    return torch.stack(steps).sum(0).exp()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of observed ``counts`` against ``probs`` (cells with < 5 expected merged)."""
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    assert counts[probs == 0].sum() == 0, "a continuation the target forbids was generated"
    big = expected >= 5  # merge the cells with small expected counts
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:
        obs = torch.cat([obs, counts[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def tiny_llama(layers: int = 4, hidden: int = 32) -> LlamaForCausalLM:
    """A random float32 Llama on the tiny codec's vocabulary (320)."""
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def randomize_lora(model: MTPCModel) -> None:
    """LoRA weights away from their zero init, so the adapter changes the draft path."""
    with torch.no_grad():
        for p in model.backbone.lora.parameters():
            p.normal_(0, 0.05)


# -------------------------------------------------- decoding: drafts, prompts, stub drafters ----
FAMILIES = [("ff", 1), ("cp", 3), ("hmm", 3), ("btree", 3)]  # (kind, rank)
PROMPTS = [[1, 5, 7, 9, 3], [40, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def make_model(
    kind: str, window: int, rank: int, k: int = 0, noise: float = 0.3, **target: int
) -> MTPCModel:
    """A draft with random (noised STP) heads and random LoRA: exactness must hold for any."""
    from mtpc.model import MTPCModel

    hf = make_target(**target)
    model = MTPCModel.from_hf(hf, kind=kind, window=window, rank=rank, lora_layers=k)
    torch.manual_seed(1)
    model.head.from_pretrained_unembeddings(hf.lm_head.weight.detach().float(), noise_std=noise)
    with torch.no_grad():
        for p in model.head.parameters():
            if p is not model.head.unembedding:
                p.normal_(0, 0.3)
        if k:
            for p in model.backbone.lora.parameters():
                p.normal_(0, 0.05)
    return model


def oracle(
    reference: list[int], window: int, wrong_from: int | None, vocab: int = 48
) -> Callable[..., torch.Tensor]:
    """Drafts the true continuation, wrong (the next id mod ``vocab``) from window position
    ``wrong_from`` on."""

    def drafter(
        params: CircuitParams, evidence: torch.Tensor | None, position: int
    ) -> torch.Tensor:
        true = (reference + [0] * (window + 1))[position : position + window]
        if evidence is not None:
            assert int(evidence[0, 0]) == true[0], "the pending token is the true next token"
        draft = [
            t if wrong_from is None or i < wrong_from else (t + 1) % vocab
            for i, t in enumerate(true)
        ]
        if evidence is not None:
            draft[0] = int(evidence[0, 0])
        return torch.tensor([draft])

    return drafter


# The sampling checks: the first SAMPLING_LENGTH tokens after SAMPLING_PROMPT, on a target of
# SAMPLING_VOCAB ids, so that all SAMPLING_VOCAB ** SAMPLING_LENGTH continuations enumerate.
SAMPLING_VOCAB, SAMPLING_LENGTH = 4, 3
SAMPLING_PROMPT = [1, 2, 3, 0]


def sampled_counts(model: MTPCModel, policy: str, draws: int, **kwargs: object) -> torch.Tensor:
    """How often each continuation (itertools.product order) came out of ``draws`` seeds."""
    import mtpc

    V, L = SAMPLING_VOCAB, SAMPLING_LENGTH
    counts = torch.zeros(V**L)
    for seed in range(draws):
        res = mtpc.generate(
            model, SAMPLING_PROMPT, L, greedy=False, seed=seed, policy=policy, stop_ids=(), **kwargs
        )
        counts[sum(t * V ** (L - 1 - i) for i, t in enumerate(res.tokens))] += 1
    return counts


def generate_with_rule(
    model: MTPCModel, prompt: list[int], new: int, rule: str | None = None, **kwargs: Any
) -> Any:
    """``mtpc.generate`` with the draft step's rule forced to ``rule`` (a ``DraftRule`` value;
    None: the drafting choice's): every rule under either verification, including a drawn
    latent path under greedy verification, which no drafting choice names."""
    import dataclasses

    import mtpc
    from mtpc.decoding.common import check_request, prompt_tensor
    from mtpc.decoding.loop import decode
    from mtpc.decoding.settings import DraftRule, check_settings
    from mtpc.decoding.speculative import Chain

    if rule is None:
        return mtpc.generate(model, prompt, new, **kwargs)
    ids = prompt_tensor(model, prompt)
    request = check_request(model, ids, check_settings(max_new_tokens=new, **kwargs))
    request = dataclasses.replace(request, draft_rule=DraftRule(rule))
    return decode(model, [ids[0]], [request], Chain(request))[0]  # a chain of one prompt
