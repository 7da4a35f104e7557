"""The settings of an evaluation (``eval.py``) and of a regeneration (``scripts/regenerate.py``),
read from the Hydra config once, at the door, as given (docs/DESIGN.md). Each default is written
once, here, and equals ``configs/eval.yaml``'s (``configs/regenerate.yaml``'s), where each field
is described; :func:`get_field` is used here only (a test greps for it)."""

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


def _read_all(cls: Any, cfg: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every field of dataclass ``cls`` but ``skip``, read at ``prefix + name`` with its default."""
    default = cls()
    return {
        k: _read(cfg, prefix + k, getattr(default, k))
        for k in cls.__dataclass_fields__
        if k not in skip
    }


def name_list(value: Any) -> Any:
    """A list of names given as one name or a list (``sources=a`` is ``[a]``); None stays."""
    return [value] if isinstance(value, str) else value


def _output_dir(cfg: Any) -> str | None:
    """``output_dir``; None also when it cannot resolve (``${hydra:...}`` outside a Hydra run)."""
    try:
        out = get_field(cfg, "output_dir")
    except Exception:
        return None
    return None if out is None else str(out)


CHUNK_BATCHES = 4
"""At ``batch_size`` B > 1, prompts (regeneration: rows) are decoded, recorded and written in
chunks of this many times B: the places of finished rows go to waiting ones within a chunk
(continuous batching); a kill loses at most a chunk's work."""

# ------------------------------------------------------------------------ evaluation ----
IDENTITY_FIELDS = (
    "greedy", "policy", "temperature", "top_k", "top_p", "num_prompts", "num_prompt_sets",
    "max_new_tokens", "warmup", "warmup_window", "suppress_eos", "max_throughput", "device",
    "english_only", "seed", "num_threads", "max_prompt_length", "sources", "tree_budget",
    "tree_floor",
)  # fmt: skip
"""Settings that define a measurement (their change starts another evaluation folder), in the
manifest's order. ``batch_size`` > 1 is added to them (another timing protocol)."""


@dataclass(frozen=True)
class ModelSettings:
    """The target (``model.*``; after :func:`mtpc.evaluation.loading.resolve_target`, the one
    the drafts were exported for). ``fields``: every ``model.*`` field as given (the
    manifest's ``target``)."""

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
        return cls(**_read_all(cls, f, skip=("fields",)), fields=f)


@dataclass(frozen=True)
class EvalDecoding:
    """How every prompt is decoded (``mtpc.generate``'s keywords; docs/DECODING.md).
    ``temperature`` is a number > 0 even when greedy ignores it; prompt i of a set decodes
    with ``seed`` + i (+ the prompt's offset)."""

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
    compile: Any = False  # the AR pass's engine: False (eager), True or a torch.compile backend


@dataclass(frozen=True)
class SpecBench:
    """``prompts=spec_bench`` (configs/prompts/spec_bench.yaml); ``path`` is relative to the
    project root, as ``draft=`` is."""

    name: Any = None
    path: Any = None
    categories: Any = None
    per_category: Any = None
    turns: Any = None


@dataclass(frozen=True)
class EvalPrompts:
    """Which prompts are decoded; ``spec_bench`` None: the data group's."""

    num_prompts: int | None = 8
    num_prompt_sets: int = 1
    english_only: bool = True
    sources: Any = None
    max_prompt_length: int | None = None
    spec_bench: SpecBench | None = None


@dataclass(frozen=True)
class EvalRun:
    """How the passes run and are timed; ``batch_size`` > 1 is part of the folder's identity
    (the times are a batch's shares)."""

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
    """Where the records and tables go; relative paths start at ``root_dir``
    (``paths.root_dir``)."""

    root_dir: Path = PROJECT_ROOT
    output_dir: str | None = None
    report: Any = None
    resume: str = "auto"
    plots: bool = True


@dataclass(frozen=True)
class Drafter:
    """``drafter=hetero`` (configs/drafter/hetero.yaml): a drafter of another vocabulary.
    None: ``generate_hetero``'s default; ``fields``: every ``drafter.*`` field as given (the
    manifest's record)."""

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
    """Everything an evaluation reads from its config, parsed once. ``given``: the settings
    of :data:`IDENTITY_FIELDS` as the config gives them (None where missing): the manifest
    records exactly these, so a folder written before this settings layer resumes."""

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
        decoding = _read_all(EvalDecoding, cfg)
        if decoding["tree_floor"] is None:  # null: no floor
            decoding["tree_floor"] = EvalDecoding.tree_floor
        spec = None
        if get_field(cfg, "prompts") is not None:
            spec = SpecBench(**_read_all(SpecBench, cfg, "prompts."))
        drafter = None
        if get_field(cfg, "drafter") is not None:
            fields = _read(cfg, "drafter")
            drafter = Drafter(
                **_read_all(Drafter, cfg, "drafter.", skip=("fields",)),
                fields=fields if isinstance(fields, Mapping) else {},
            )
        root = get_field(cfg, "paths.root_dir")
        output = _read_all(EvalOutput, cfg, skip=("root_dir", "output_dir"))
        return cls(
            draft=_read(cfg, "draft"),
            baseline=_read(cfg, "baseline"),
            model=ModelSettings.from_fields(_read(cfg, "model")),
            data=_read(cfg, "data"),
            decoding=EvalDecoding(**decoding),
            prompts=EvalPrompts(
                **_read_all(EvalPrompts, cfg, skip=("spec_bench",)), spec_bench=spec
            ),
            run=EvalRun(**_read_all(EvalRun, cfg)),
            output=EvalOutput(
                **output, root_dir=Path(root) if root else PROJECT_ROOT, output_dir=_output_dir(cfg)
            ),
            drafter=drafter,
            given={k: _read(cfg, k) for k in IDENTITY_FIELDS},
        )


def explicit_model_fields(overrides: list[str], cfg: Any) -> dict[str, Any]:
    """The ``model.*`` fields a command line sets (``model=<group>`` sets ``name``), with the
    values ``cfg`` composed for them; ``overrides``: Hydra's task overrides, e.g.
    ``["draft=d", "model=evabyte", "model.path=/ckpt"]``."""
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
    """How every assistant turn of a regeneration is decoded (part of the manifest's identity;
    fields: configs/regenerate.yaml). ``method`` speculative needs ``draft``."""

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
    compile: Any = False  # the engine (autoregressive only, so far): not the rows' law

    def output_law(self) -> dict[str, Any]:
        """The settings that decide what is written (not how fast): the manifest's identity.

        The decoder (autoregressive or speculative, the draft, its policy and mode) is left
        out: it is lossless, so it changes the speed, not the rows' law. Greedy output is
        the same byte for byte; sampled output the same in distribution (not per seed), so a
        sampled folder records the decoder too.
        """
        keys: tuple[str, ...] = ("greedy", "max_new_tokens", "seed")
        if not self.greedy:  # the sampling parameters, then the decoder
            keys += ("temperature", "top_k", "top_p")
            keys += ("method", "draft", "policy", "drafting", "proposal")
        return {k: getattr(self, k) for k in keys}


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
    """Everything a regeneration reads from its config, parsed once. ``data``: the fields of
    :data:`REGENERATE_DATA` (None where missing); ``root_dir`` None: the working directory;
    ``batch_size`` is not part of the manifest (the rows do not depend on it)."""

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
        """Reads every field a regeneration uses (checked first: ``checks.parse_regenerate``)."""
        d = Settings()
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
            compile=_read(cfg, "compile", d.compile),
        )
        return cls(
            **_read_all(cls, cfg, skip=("decoder", "model", "data", "output_dir", "root_dir")),
            decoder=decoder,
            model=ModelSettings.from_fields(_read(cfg, "model")),
            data={k: _read(cfg, f"data.{k}") for k in REGENERATE_DATA},
            output_dir=_read(cfg, "output_dir") or _regenerate_folder(cfg, decoder),
            root_dir=_read(cfg, "paths.root_dir", cls.root_dir),
        )
