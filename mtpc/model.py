"""MTPCModel: a frozen target + its STP head (verifier) + an MTPC head (draft) + LoRA tail
(data flow: docs/BACKBONES.md, docs/DESIGN.md, paper Sec. 3.4). Hidden states returned by
``trunk``/``*_tail`` are pre-norm; ``verifier_logits`` and ``draft_params`` apply the norm."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mtpc.backbones import Backbone, LayerCache, backbone_from_hf, load_backbone, resolve_dtype
from mtpc.backbones.lora import LoraSettings, as_settings, attach_lora, validate_lora
from mtpc.choices import HEAD_INITS, MODEL_NAMES
from mtpc.export import check_codec, check_target, read_adapter, read_config, read_head, save_draft

if TYPE_CHECKING:
    from mtpc.heads import MTPCHead


def assign_codec(backbone: Backbone) -> None:
    """Only byte models get a byte codec: a generic HF Llama keeps the tiny target's default
    codec only when its vocabulary is that codec's (else decoding stops on its eos ids)."""
    if backbone.name != "llama" or backbone.codec is None:
        return
    from mtpc.backbones.codecs import get_codec

    try:
        vocab = get_codec(backbone.codec).vocab_size
    except (ValueError, KeyError):
        vocab = None
    if vocab != backbone.vocab_size:
        backbone.codec = None  # type: ignore[assignment]  # Backbone.codec: a name or None


def _cat_ids(past: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """The id history ``past`` (B, P) followed by ``ids`` (B, A); None when both are empty."""
    if past is None:
        return ids if ids.shape[1] else None
    return torch.cat([past, ids], 1)


@dataclass
class Caches:
    """The three component caches of one decoding stream (S, V, D)."""

    trunk: LayerCache
    verifier: LayerCache
    draft: LayerCache

    def __iter__(self):
        return iter((self.trunk, self.verifier, self.draft))

    def crop(self, length: int) -> None:
        """Crops every cache longer than ``length``."""
        for c in self:
            if len(c) > length:
                c.crop(length)

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keeps positions [0, base) and ``base + keep`` of the trunk and verifier caches (a
        verified tree's accepted path); the draft tail runs on the kept states afterwards."""
        self.trunk.compact(base, keep)
        self.verifier.compact(base, keep)

    def clone(self) -> Caches:
        return Caches(self.trunk.clone(), self.verifier.clone(), self.draft.clone())

    def reset(self) -> None:
        for c in self:
            c.reset()


@dataclass
class MTPCOutput:
    """Training forward output."""

    draft_features: torch.Tensor  # (B, T, d) normed draft hidden states, the head's input
    verifier_logits: torch.Tensor | None = None  # (B, T, V) STP logits, no grad (KL loss)


class MTPCModel(nn.Module):
    """Backbone + STP head (verifier) + MTPC head (draft) + LoRA draft tail; only the head and
    the LoRA weights are trainable; ``split`` = L - k is the first tail layer."""

    def __init__(
        self, backbone: Backbone, head: MTPCHead, lora: LoraSettings, head_init: str
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.lora = lora
        self.head_init = head_init
        self.split = backbone.num_layers - lora.layers
        self._fingerprint: str | None = None

    @classmethod
    def from_backbone(
        cls,
        backbone: Backbone,
        kind: str,
        window: int,
        rank: int,
        lora_layers: int = 0,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        lora_target_modules: Sequence[str] | None = None,
        head_init: str = "pretrained",
        head_dtype: str | torch.dtype = "float32",
        lora: LoraSettings | None = None,
        **head_options: Any,
    ) -> MTPCModel:
        """Attaches a head (and LoRA on the last ``lora_layers`` layers) to a backbone;
        ``lora``: the LoRA settings as one record (then the ``lora_*`` arguments are unused);
        ``head_options`` go to ``MTPCHead``. Bad settings raise before anything is attached
        (``lora.*``: ``LoraError``)."""
        from mtpc.heads import MTPCHead

        assign_codec(backbone)
        if head_init not in HEAD_INITS:
            raise ValueError(f"head_init is {head_init!r}; allowed: {list(HEAD_INITS)}")
        settings = lora or as_settings(
            lora_layers, lora_rank, lora_alpha, lora_dropout, lora_target_modules
        )
        validate_lora(settings, backbone.layers)
        head = MTPCHead(
            kind, window, rank, backbone.vocab_size, backbone.hidden_size, **head_options
        )
        head.to(device=backbone.device, dtype=resolve_dtype(head_dtype, backbone.device))
        if head_init != "random":  # pretrained: the MTP heads where the target has them
            u = backbone.mtp_unembeddings() if head_init == "pretrained" else None
            head.from_pretrained_unembeddings(u if u is not None else backbone.stp_unembedding())
        if backbone.lora is not None:
            raise ValueError("this backbone already has a LoRA adapter; load the target again")
        backbone.lora = attach_lora(backbone.hf_model, backbone.layers, settings)
        return cls(backbone, head, settings, head_init)

    @classmethod
    def from_hf(
        cls,
        hf_causal_lm: Any,
        kind: str,
        window: int,
        rank: int,
        lora_layers: int = 0,
        mtp_unembeddings: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> MTPCModel:
        """Wraps a loaded HF causal LM; ``mtp_unembeddings``: (m * V, d), EvaByte's layout."""
        backbone = backbone_from_hf(hf_causal_lm, mtp_unembeddings)
        return cls.from_backbone(backbone, kind, window, rank, lora_layers, **kwargs)

    @classmethod
    def target_only(cls, target: Any) -> MTPCModel:
        """The target alone (an HF causal LM, ``TinyTarget`` or ``Backbone``) as an
        ``MTPCModel`` for autoregressive decoding: a one-position FF head it never reads."""
        return cls.from_backbone(backbone_from_hf(target), "ff", 1, 1, head_init="stp")

    @classmethod
    def from_config(
        cls,
        model: str = "tiny",
        kind: str = "cp",
        window: int = 4,
        rank: int = 2,
        lora_layers: int = 0,
        path: str | None = None,
        revision: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        attention_impl: str = "auto",
        **kwargs: Any,
    ) -> MTPCModel:
        """Flat builder for Hydra: loads ``model`` (see ``load_backbone``) and attaches a head."""
        backbone = load_backbone(model, path, revision, dtype, device, attention_impl)
        return cls.from_backbone(backbone, kind, window, rank, lora_layers, **kwargs)

    @property
    def k(self) -> int:
        return self.lora.layers

    def new_caches(self) -> Caches:
        """Empty caches S (trunk), V (verifier tail), D (draft tail)."""
        b, split, n = self.backbone, self.split, self.backbone.num_layers
        return Caches(b.new_cache(0, split), b.new_cache(split, n), b.new_cache(split, n))

    def trunk(
        self,
        ids: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeds ``ids`` (B, T) and runs layers 0..L-k-1 -> pre-norm hidden (B, T, d). With
        a cache, ``ids`` follow the cached ones and are recorded (the byte Llama's embedding
        reads the history); ``tree_mask`` and ``attend``: ``Backbone.run_layers``; ``hidden``:
        the ids' embeddings when the caller made them (:meth:`embed`)."""
        if hidden is None:
            hidden = self.embed(ids, None if cache is None else cache.ids, tree_mask)
        hidden = self.backbone.run_layers(  # adapter off
            hidden, 0, self.split, positions, cache, False, documents, tree_mask, attend
        )
        if cache is not None:
            cache.record_ids(ids)
        return hidden

    def embed(
        self, ids: torch.Tensor, past: torch.Tensor | None, tree_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Input embeddings of ``ids`` (B, T) after the history ``past`` (B, P) -> (B, T, d);
        a token tree's nodes (``tree_mask`` (T, T)) each after its own root path."""
        if tree_mask is not None and self.backbone.needs_history:
            nodes = []
            for i in range(ids.shape[1]):
                ancestors = ids[:, :i][:, tree_mask[i, :i]]  # (B, depth)
                nodes.append(self.backbone.embed(ids[:, i : i + 1], _cat_ids(past, ancestors)))
            return torch.cat(nodes, 1)  # (B, T, d)
        return self.backbone.embed(ids, past)  # (B, T, d)

    def verifier_tail(
        self,
        hidden: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        *,
        adapter: bool = False,
    ) -> torch.Tensor:
        """Layers L-k..L-1 with base weights (``adapter``: with the LoRA adapter on, as
        :meth:`draft_tail`): (B, T, d) -> (B, T, d)."""
        L, adapter = self.backbone.num_layers, adapter and self.k > 0
        return self.backbone.run_layers(
            hidden, self.split, L, positions, cache, adapter, documents, tree_mask, attend
        )

    def draft_tail(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Layers L-k..L-1 with the LoRA adapter on (arguments: :meth:`verifier_tail`)."""
        return self.verifier_tail(hidden, *args, adapter=True, **kwargs)

    def verifier_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target next-token logits of verifier-tail hidden states (..., d) -> (..., V)."""
        return self.backbone.stp_logits(self.backbone.norm(hidden))

    def draft_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed draft-tail hidden states (..., d): what the MTPC head reads."""
        return self.backbone.norm(hidden)

    def draft_params(self, hidden: torch.Tensor) -> Any:
        """Circuit parameters theta_t of draft-tail hidden states (..., d), flattened to (B*, d)."""
        e = self.draft_features(hidden).reshape(-1, self.backbone.hidden_size)  # (B*, d)
        return self.head(e)

    def forward(
        self,
        ids: torch.Tensor,
        return_verifier_logits: bool = False,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> MTPCOutput:
        """Training forward (no cache): ids (B, T) -> draft features, optional verifier logits."""
        with torch.no_grad():
            trunk = self.trunk(ids, None, positions, documents)  # (B, T, d)
        features = self.draft_features(self.draft_tail(trunk, None, positions, documents))
        logits = None
        if return_verifier_logits:
            with torch.no_grad():
                verified = (
                    self.verifier_tail(trunk, None, positions, documents) if self.k else trunk
                )
                logits = self.verifier_logits(verified)  # (B, T, V)
        return MTPCOutput(features, logits)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The head's parameters and the LoRA weights (nothing of the frozen target)."""
        lora = [] if self.backbone.lora is None else self.backbone.lora.parameters()
        return [p for p in (*self.head.parameters(), *lora) if p.requires_grad]  # not FF's (0, d)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA weights by peft name (``...lora_A.default.weight``); empty for k = 0."""
        return {} if self.backbone.lora is None else self.backbone.lora.state_dict()

    def target_fingerprint(self) -> str:
        """sha256 fingerprint of the frozen target weights (cached)."""
        if self._fingerprint is None:
            self._fingerprint = self.backbone.weights_fingerprint()
        return self._fingerprint

    def save_pretrained(self, path: str | Path, **card: Any) -> Path:
        """Writes head + LoRA safetensors, config.json and README.md (see ``mtpc.export``)."""
        return save_draft(self, path, **card)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target: Any = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> MTPCModel:
        """Rebuilds an exported draft against ``target``, or against its recorded target loaded
        on ``device`` in ``dtype``; DraftError or TargetMismatchError (``mtpc.export``)."""
        folder = Path(path)
        config = read_config(folder)
        t, c, lora = config["target"], config["circuit"], config["lora"]
        backbone = (
            backbone_from_hf(target) if target is not None else _recorded_target(t, device, dtype)
        )
        fingerprint = check_target(t, backbone)  # first: nothing attached to a wrong one
        assign_codec(backbone)
        check_codec(config, backbone, folder)
        model = cls.from_backbone(
            backbone, c["kind"], c["window"], c["rank"], lora_layers=lora["layers"],
            lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
            lora_target_modules=lora["target_modules"], head_init="random",
            head_dtype=c.get("dtype", "float32"),
            homogeneous=bool(c.get("homogeneous", False)),
            contextual_transitions=bool(c.get("contextual_transitions", True)),
        )  # fmt: skip
        model.head_init = config.get("head_init", "pretrained")
        model._fingerprint = fingerprint
        model.head.load_state_dict(read_head(folder, config, model.head, backbone.device))
        if lora["layers"] > 0:
            assert backbone.lora is not None
            backbone.lora.load_state_dict(read_adapter(folder, lora["layers"], backbone.device))
        return model


def _recorded_target(t: dict[str, Any], device: str | None, dtype: str | None) -> Backbone:
    """The target a draft's ``config.json`` records (``target``), loaded again."""
    dtype, device = dtype or t.get("dtype", "float32"), device or "cpu"
    if t.get("model") == "hf":
        if not t.get("path"):
            raise ValueError(
                "config.json target.path is empty (the target was built in memory); "
                "pass target=<the loaded model> to from_pretrained"
            )
        from transformers import AutoModelForCausalLM

        torch_dtype = resolve_dtype(dtype, device)
        hf = AutoModelForCausalLM.from_pretrained(
            t["path"], revision=t.get("revision"), dtype=torch_dtype
        )
        hf.to(device)  # type: ignore[arg-type]
        return backbone_from_hf(hf.eval())
    if t.get("model") not in MODEL_NAMES:
        raise ValueError(
            f"config.json target.model is {t.get('model')!r}; allowed: tiny, evabyte, llama3_byte, hf "
            "(or pass target=<the loaded model>)"
        )
    return load_backbone(
        t["model"], path=t.get("path"), revision=t.get("revision"), dtype=dtype, device=device
    )
