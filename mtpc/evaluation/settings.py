"""The settings of an evaluation (``eval.py``) and of a regeneration (``scripts/regenerate.py``),
read from the Hydra config once, at the door.

:meth:`EvalSettings.from_cfg` and :meth:`RegenerateSettings.from_cfg` are the only readers of
the raw config (the dotted getter :func:`get_field` is used here and nowhere else): every field's
default is written once, in the dataclasses below, and equals ``configs/eval.yaml``'s
(``configs/regenerate.yaml``'s). The values are kept as given (a bad one is refused, with one
line naming the field, by ``mtpc.evaluation.checks``: :func:`~mtpc.evaluation.checks.parse_eval`
and :func:`~mtpc.evaluation.checks.parse_regenerate` read and check); below the entry points,
functions take these frozen objects or their named fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""``paths.root_dir`` when the config has none."""


def get_field(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s field ``key`` (dotted) of a config or a plain mapping; ``default`` if missing."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=default)
    node = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def plain(value: Any) -> Any:
    """``value`` as plain Python (a config node resolved to dicts and lists)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _read(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s field ``key`` as plain Python; ``default`` if missing."""
    return plain(get_field(cfg, key, default))


def _output_dir(cfg: Any) -> str | None:
    """``output_dir``; None also when it cannot resolve (``${hydra:...}`` outside a Hydra run)."""
    try:
        out = get_field(cfg, "output_dir")
    except Exception:
        return None
    return None if out is None else str(out)


def _root_dir(cfg: Any) -> Path:
    root = get_field(cfg, "paths.root_dir")
    return Path(root) if root else PROJECT_ROOT


CHUNK_BATCHES = 4
"""At ``batch_size`` B > 1, prompts (regeneration: rows) are decoded, recorded and written in
chunks of this many times B: the places of finished rows go to waiting ones within a chunk
(continuous batching); a kill loses at most a chunk's work."""

# ------------------------------------------------------------------------ evaluation ----
IDENTITY_FIELDS = (
    "greedy", "policy", "temperature", "top_k", "top_p", "num_prompts",
    "num_prompt_sets", "max_new_tokens", "warmup", "warmup_window", "suppress_eos",
    "max_throughput",
    "device", "english_only", "seed", "num_threads", "max_prompt_length", "sources",
    "tree_budget", "tree_floor",
)  # fmt: skip
"""Settings that define a measurement (their change starts another evaluation folder), in the
manifest's order. ``batch_size`` > 1 is added to them (another timing protocol)."""


@dataclass(frozen=True)
class ModelSettings:
    """The target (``model.*``; after :func:`mtpc.evaluation.loading.resolve_target`, the one
    the drafts were exported for).

    Attributes:
        name: a registry name (``tiny``, ``evabyte``, ...) or ``hf``.
        path: a local checkpoint or hub id; None: the model's default.
        revision: the hub revision, or None.
        dtype: the weights' dtype.
        codec: the byte codec.
        attention_impl: EvaByte's attention path.
        fields: every ``model.*`` field as given (the manifest's ``target``).
    """

    name: str = "tiny"
    path: str | None = None
    revision: str | None = None
    dtype: str = "float32"
    codec: str = "tiny"
    attention_impl: str = "auto"
    fields: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any] | None) -> ModelSettings:
        """The settings of a ``model`` section (a plain mapping)."""
        f = dict(fields or {})
        d = cls()
        return cls(
            name=f.get("name", d.name), path=f.get("path", d.path),
            revision=f.get("revision", d.revision), dtype=f.get("dtype", d.dtype),
            codec=f.get("codec", d.codec), attention_impl=f.get("attention_impl", d.attention_impl),
            fields=f,
        )  # fmt: skip


@dataclass(frozen=True)
class EvalDecoding:
    """How every prompt is decoded (``mtpc.generate``'s keywords; docs/DECODING.md).

    Attributes:
        max_new_tokens: ids per prompt (per turn).
        greedy: argmax decoding; False: speculative sampling.
        policy: condition | recompute | drop.
        temperature: sampling temperature (a number > 0 even when greedy ignores it).
        top_k: keep the k most likely ids (sampling), or None.
        top_p: nucleus filtering (sampling), or None.
        suppress_eos: decode past EOS (fixed-length generation, paper App. F).
        seed: set k, prompt i decodes with seed + i (+ the prompt's offset).
        drafting: the chain's draft: path | map | chain; None: the family default.
        proposal: sampling's proposal; None: the family default.
        tree_budget: None, an int or a list: one ``tree<B>`` row per positive budget.
        tree_floor: token trees leave out nodes with q(path) below it.
    """

    max_new_tokens: int = 128
    greedy: bool = True
    policy: str = "condition"
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    suppress_eos: bool = False
    seed: int = 0
    drafting: str | None = None
    proposal: str | None = None
    tree_budget: Any = None
    tree_floor: float = 0.0


@dataclass(frozen=True)
class SpecBench:
    """``prompts=spec_bench`` (configs/prompts/spec_bench.yaml).

    Attributes:
        name: ``spec_bench``.
        path: the question.jsonl (relative to the project root, as ``draft=`` is).
        categories: only these categories (a name or a list); None: all.
        per_category: the first N questions of each category; None: all.
        turns: the first N turns of each question; None: all.
    """

    name: Any = None
    path: Any = None
    categories: Any = None
    per_category: Any = None
    turns: Any = None


@dataclass(frozen=True)
class EvalPrompts:
    """Which prompts are decoded.

    Attributes:
        num_prompts: prompts per set (Spec-Bench: questions, None: all).
        num_prompt_sets: prompt sets, seeds seed..seed+sets-1.
        english_only: only English prompts.
        sources: only prompts of these sources (a name or a list); None: all.
        max_prompt_length: longest prompt in ids; None: the target's context allows.
        spec_bench: Spec-Bench's questions instead of the data group's; None: the data group's.
    """

    num_prompts: int | None = 8
    num_prompt_sets: int = 1
    english_only: bool = True
    sources: Any = None
    max_prompt_length: int | None = None
    spec_bench: SpecBench | None = None

    @property
    def source_list(self) -> list[str] | None:
        """``sources`` as a list (``sources=a`` is ``[a]``); None: every source."""
        return [self.sources] if isinstance(self.sources, str) else self.sources


@dataclass(frozen=True)
class EvalRun:
    """How the passes run and are timed.

    Attributes:
        device: cpu | cuda | cuda:<i>.
        num_threads: CPU threads; None: torch's default.
        warmup: untimed runs of each warm-up prompt before each timed pass.
        warmup_window: also warm up on a prompt longer than one attention window.
        max_throughput: also run accepting every draft.
        interleave: decode every draft (and AR) prompt by prompt, alternating their order.
        progress: a progress bar per draft and pass.
        batch_size: prompts decoded at once (1: the paper's protocol); > 1 is part
            of the folder's identity (the times are a batch's shares).
    """

    device: str = "cpu"
    num_threads: int | None = 1
    warmup: int = 1
    warmup_window: bool = True
    max_throughput: bool = True
    interleave: bool = False
    progress: bool = True
    batch_size: int = 1


@dataclass(frozen=True)
class EvalOutput:
    """Where the records and tables go.

    Attributes:
        root_dir: the project root (``paths.root_dir``): relative paths start there.
        output_dir: the evaluation folder (or the merged report's); None: named from the
            drafts and settings under ``outputs/eval``.
        report: a folder or a list (globs allowed): rebuild the tables, no decoding; None: decode.
        resume: auto | force | never.
        plots: write the plots.
    """

    root_dir: Path = PROJECT_ROOT
    output_dir: str | None = None
    report: Any = None
    resume: str = "auto"
    plots: bool = True


@dataclass(frozen=True)
class Drafter:
    """``drafter=hetero`` (configs/drafter/hetero.yaml): a drafter of another vocabulary.

    Attributes:
        model: a local HF causal-LM folder or ``fixture:<name>``.
        tokenizer: its tokenizer (folder or codec name); None: the model folder's.
        algorithm: slem | tli | slrs | union | standard.
        lookahead: drafter tokens per cycle.
        look_behind: slem's re-encoded target tokens; None: ``generate_hetero``'s default.
        max_psi_paths: slrs's bound on drafter passes; None: ``generate_hetero``'s default.
        psi: slrs's psi method; None: ``generate_hetero``'s default.
        fields: every ``drafter.*`` field as given (the manifest's record).
    """

    model: Any = None
    tokenizer: Any = None
    algorithm: str = "slem"
    lookahead: int = 5
    look_behind: int | None = None
    max_psi_paths: int | None = None
    psi: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSettings:
    """Everything an evaluation reads from its config (``configs/eval.yaml``), parsed once.

    Attributes:
        draft: the exported draft folder(s) (a path or a list); None: the last trained one.
        baseline: an FF draft folder (or a list) for the ``x baseline`` column, or None.
        model: the target.
        data: the ``data`` group (instantiated for the prompts), or None.
        decoding: how each prompt is decoded.
        prompts: which prompts.
        run: how the passes run.
        output: where the results go.
        drafter: ``drafter=hetero``'s drafter, or None.
        given: the measurement's settings as the config gives them (:data:`IDENTITY_FIELDS`,
            None where missing): the manifest records exactly these, so a folder written
            before this settings layer resumes.
    """

    draft: Any = None
    baseline: Any = None
    model: ModelSettings = field(default_factory=ModelSettings)
    data: Mapping[str, Any] | None = None
    decoding: EvalDecoding = field(default_factory=EvalDecoding)
    prompts: EvalPrompts = field(default_factory=EvalPrompts)
    run: EvalRun = field(default_factory=EvalRun)
    output: EvalOutput = field(default_factory=EvalOutput)
    drafter: Drafter | None = None
    given: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_cfg(cls, cfg: Any) -> EvalSettings:
        """Reads every field the evaluation uses (unchecked: ``checks.parse_eval`` checks)."""
        dec, pro, run, out = EvalDecoding(), EvalPrompts(), EvalRun(), EvalOutput()
        floor = _read(cfg, "tree_floor", dec.tree_floor)
        decoding = EvalDecoding(
            max_new_tokens=_read(cfg, "max_new_tokens", dec.max_new_tokens),
            greedy=_read(cfg, "greedy", dec.greedy),
            policy=_read(cfg, "policy", dec.policy),
            temperature=_read(cfg, "temperature", dec.temperature),
            top_k=_read(cfg, "top_k", dec.top_k),
            top_p=_read(cfg, "top_p", dec.top_p),
            suppress_eos=_read(cfg, "suppress_eos", dec.suppress_eos),
            seed=_read(cfg, "seed", dec.seed),
            drafting=_read(cfg, "drafting", dec.drafting),
            proposal=_read(cfg, "proposal", dec.proposal),
            tree_budget=_read(cfg, "tree_budget", dec.tree_budget),
            tree_floor=dec.tree_floor if floor is None else floor,  # null: no floor
        )
        spec = None
        if get_field(cfg, "prompts") is not None:
            spec = SpecBench(
                **{k: _read(cfg, f"prompts.{k}") for k in SpecBench.__dataclass_fields__}
            )
        prompts = EvalPrompts(
            num_prompts=_read(cfg, "num_prompts", pro.num_prompts),
            num_prompt_sets=_read(cfg, "num_prompt_sets", pro.num_prompt_sets),
            english_only=_read(cfg, "english_only", pro.english_only),
            sources=_read(cfg, "sources", pro.sources),
            max_prompt_length=_read(cfg, "max_prompt_length", pro.max_prompt_length),
            spec_bench=spec,
        )
        run_settings = EvalRun(
            **{k: _read(cfg, k, getattr(run, k)) for k in EvalRun.__dataclass_fields__}
        )
        output = EvalOutput(
            root_dir=_root_dir(cfg),
            output_dir=_output_dir(cfg),
            report=_read(cfg, "report", out.report),
            resume=_read(cfg, "resume", out.resume),
            plots=_read(cfg, "plots", out.plots),
        )
        drafter = None
        if get_field(cfg, "drafter") is not None:
            fields = _read(cfg, "drafter")
            d = Drafter()
            drafter = Drafter(
                **{
                    k: _read(cfg, f"drafter.{k}", getattr(d, k))
                    for k in Drafter.__dataclass_fields__
                    if k != "fields"
                },
                fields=fields if isinstance(fields, Mapping) else {},
            )
        return cls(
            draft=_read(cfg, "draft"),
            baseline=_read(cfg, "baseline"),
            model=ModelSettings.from_fields(_read(cfg, "model")),
            data=_read(cfg, "data"),
            decoding=decoding,
            prompts=prompts,
            run=run_settings,
            output=output,
            drafter=drafter,
            given={k: _read(cfg, k) for k in IDENTITY_FIELDS},
        )


def explicit_model_fields(overrides: list[str], cfg: Any) -> dict[str, Any]:
    """The ``model.*`` fields a command line sets (``model=<group>`` sets ``name``), with the
    values ``cfg`` composed for them; every other field of ``cfg.model`` is a group default.

    Args:
        overrides: Hydra's task overrides (``HydraConfig.get().overrides.task``), e.g.
            ``["draft=d", "model=evabyte", "model.path=/ckpt"]``.
        cfg: the composed config.
    """
    fields: dict[str, Any] = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "model":
            fields["name"] = get_field(cfg, "model.name")
        elif key.startswith("model."):
            fields[key.removeprefix("model.")] = _read(cfg, key)
    return fields


def hydra_model_overrides(cfg: Any) -> dict[str, Any] | None:
    """The ``model.*`` fields of this Hydra run's command line; ``None`` outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return explicit_model_fields(list(HydraConfig.get().overrides.task), cfg)


# ---------------------------------------------------------------------- regeneration ----
@dataclass(frozen=True)
class Settings:
    """How every assistant turn of a regeneration is decoded (part of the manifest's identity).

    Attributes:
        method: ``autoregressive`` or ``speculative`` (needs ``draft``).
        draft: the exported draft folder (speculative), else None.
        greedy: argmax decoding; False: sampling.
        temperature: sampling temperature (> 0).
        top_k: keep the k most likely ids (sampling), or None.
        top_p: nucleus filtering (sampling), or None.
        max_new_tokens: at most this many ids per assistant turn (fewer where the context ends).
        seed: base seed of the per-turn seeds.
        policy: speculative decoding's correction policy.
        drafting: speculative decoding's draft (docs/DECODING.md, "Drafting"; None: the
            family default).
        proposal: speculative sampling's proposal (None: the family default).
    """

    method: str = "autoregressive"
    draft: str | None = None
    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 1024
    seed: int = 0
    policy: str = "condition"
    drafting: str | None = None
    proposal: str | None = None

    def output_law(self) -> dict[str, Any]:
        """The settings that decide what is written (not how fast): the manifest's identity.

        The decoder (autoregressive or speculative, the draft, its policy and mode) is left
        out: it is lossless, so it changes the speed, not the rows' law. Greedy output is
        the same byte for byte; sampled output the same in distribution (not per seed), so a
        sampled folder records the decoder too.
        """
        law: dict[str, Any] = {
            "greedy": self.greedy,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }
        if not self.greedy:
            law |= {
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "method": self.method,
                "draft": self.draft,
                "policy": self.policy,
                "drafting": self.drafting,
                "proposal": self.proposal,
            }
        return law


def _regenerate_folder(cfg: Any, decoder: Settings) -> str:
    """``outputs/regenerate/<model>-<data source>-<greedy | t<T>>-seed<seed>`` (the temperature
    as the config writes it)."""
    root = Path(_read(cfg, "paths.root_dir") or ".")
    mode = "greedy" if decoder.greedy else f"t{_read(cfg, 'temperature', decoder.temperature)}"
    source = "path" if _read(cfg, "data.path") else _read(cfg, "data.source", "synthetic")
    name = f"{_read(cfg, 'model.name')}-{source}-{mode}-seed{_read(cfg, 'seed', decoder.seed)}"
    return str(root / "outputs" / "regenerate" / name)


REGENERATE_DATA = ("source", "path", "num_rows", "seed", "streaming", "revision", "hf_name")
"""The ``data.*`` fields a regeneration reads (its manifest's ``data``, with the source's
fingerprint and name)."""


@dataclass(frozen=True)
class RegenerateSettings:
    """Everything a regeneration reads from its config (``configs/regenerate.yaml``), parsed once.

    Attributes:
        decoder: how every assistant turn is decoded (the manifest's ``settings`` and ``decoder``).
        model: the target.
        data: the ``data.*`` fields of :data:`REGENERATE_DATA` (None where missing).
        shard: this process writes the rows whose index % num_shards == shard.
        num_shards: the number of shards.
        output_dir: the output folder (``output_dir``; null:
            ``outputs/regenerate/<model>-<data source>-<greedy | t<T>>-seed<seed>``).
        root_dir: the project root (``paths.root_dir``); None: the working directory.
        device: cpu | cuda | cuda:<i>.
        num_threads: CPU threads; None: torch's default.
        progress: a tqdm bar.
        batch_size: rows decoded at once (1: the paper's protocol); not part of the manifest
            (the rows do not depend on it).
    """

    decoder: Settings = field(default_factory=Settings)
    model: ModelSettings = field(default_factory=ModelSettings)
    data: Mapping[str, Any] = field(default_factory=dict)
    shard: int = 0
    num_shards: int = 1
    output_dir: str = "."
    root_dir: str | None = None
    device: str = "cpu"
    num_threads: int | None = 1
    progress: bool = True
    batch_size: int = 1

    @classmethod
    def from_cfg(cls, cfg: Any) -> RegenerateSettings:
        """Reads every field a regeneration uses (``mtpc.config.validate_regenerate_config``
        checks them first: ``checks.parse_regenerate``)."""
        d, s = Settings(), cls()
        draft = _read(cfg, "draft")
        top_p = _read(cfg, "top_p", d.top_p)
        decoder = Settings(
            method="speculative" if draft else "autoregressive",
            draft=str(Path(draft).expanduser().resolve()) if draft else None,
            greedy=bool(_read(cfg, "greedy", d.greedy)),
            temperature=float(_read(cfg, "temperature", d.temperature)),
            top_k=_read(cfg, "top_k", d.top_k),
            top_p=None if top_p is None else float(top_p),
            max_new_tokens=int(_read(cfg, "max_new_tokens", d.max_new_tokens)),
            seed=int(_read(cfg, "seed", d.seed)),
            policy=str(_read(cfg, "policy", d.policy)),
            drafting=_read(cfg, "drafting", d.drafting),
            proposal=_read(cfg, "proposal", d.proposal),
        )
        return cls(
            decoder=decoder,
            model=ModelSettings.from_fields(_read(cfg, "model")),
            data={k: _read(cfg, f"data.{k}") for k in REGENERATE_DATA},
            shard=_read(cfg, "shard", s.shard),
            num_shards=_read(cfg, "num_shards", s.num_shards),
            output_dir=_read(cfg, "output_dir") or _regenerate_folder(cfg, decoder),
            root_dir=_read(cfg, "paths.root_dir", s.root_dir),
            device=_read(cfg, "device", s.device),
            num_threads=_read(cfg, "num_threads", s.num_threads),
            progress=_read(cfg, "progress", s.progress),
            batch_size=_read(cfg, "batch_size", s.batch_size),
        )
