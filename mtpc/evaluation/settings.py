"""The schema of an evaluation (``eval.py``): every setting declared once with its default and
its rule (``mtpc.config``), read and checked once, at the door (:func:`parse_eval`), before
anything loads. Each default equals ``configs/eval.yaml``'s, where each field is described. The
batch rules (:data:`BATCH_SIZE`, :func:`check_batch`, :data:`CHUNK_BATCHES`) and
:func:`refusing` are shared with regeneration's schema (``mtpc.regeneration``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mtpc.config import (
    ConfigError,
    DataChecks,
    ModelSettings,
    checked_as,
    choice,
    computed,
    given,
    integer,
    names,
    read,
    section,
    setting,
)
from mtpc.decoding.settings import CONFIG, SettingsError, Spelling, check_drafting, check_settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""``paths.root_dir`` when the config has none."""
BATCH_SIZE = integer(1, allowed="an integer >= 1 (1: one prompt at a time, the paper's protocol)")
BOOLEAN, OPTIONAL_BOOLEAN = choice(True, False), choice(True, False, null=True)
"""The evaluator's flags (their refusal says ``allowed: True, False``)."""


class EvalConfigError(ConfigError):
    """An evaluation setting outside what the evaluator accepts; names the field."""


class _Evaluator:  # a section of the evaluator's own fields
    error: ClassVar[type[Exception]] = EvalConfigError


def name_list(value: Any) -> Any:
    """A list of names given as one name or a list (``sources=a`` is ``[a]``); None stays."""
    return [value] if isinstance(value, str) else value


@contextlib.contextmanager
def refusing(error: type[Exception]) -> Iterator[None]:
    """Turns a decoding check's SettingsError into ``error``, the same one line."""
    try:
        yield
    except SettingsError as err:
        raise error(str(err)) from None


def check_batch(batch_size: int, model: str, error: type[Exception]) -> None:
    """``batch_size`` > 1 needs a target whose backbone class batches (asked before loading)."""
    from mtpc.backbones import backbone_class, check_batch_size

    check_batch_size(batch_size, backbone_class(model), model=model, error=error)


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
class EvalDecoding(_Evaluator):
    """How every prompt is decoded (``mtpc.generate``'s keywords; docs/DECODING.md), checked as
    ``mtpc.generate`` checks them, so a bad one gets the same one line. ``temperature`` is a
    number > 0 even when greedy ignores it; prompt i of a set decodes with ``seed`` + i (+ the
    prompt's offset)."""

    max_new_tokens: int = setting(128, integer(1), error=ConfigError)
    greedy: bool = True
    policy: str = "condition"
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    suppress_eos: bool = setting(False, BOOLEAN)
    seed: int = setting(0, integer(0), error=ConfigError)
    drafting: str | None = None
    proposal: str | None = None
    tree_budget: Any = None
    tree_floor: float = setting(0.0, or_default=True)  # null: no floor
    compile: Any = False  # the AR and chain passes' engine: False (eager), True or a backend

    def __post_init__(self) -> None:
        from mtpc.evaluation.drafting import check_eval_drafting, tree_budgets

        with refusing(EvalConfigError):
            check_eval_drafting(self.drafting, self.tree_budget)  # before: drafting=tree
            decoding = ("policy", "greedy", "temperature", "top_k", "top_p")
            fields = {f: v for f in decoding if (v := getattr(self, f)) is not None}
            asked = {"draft": self.drafting, "proposal": self.proposal}
            greedy = check_settings(CONFIG, **fields, **asked).greedy
            budget = max(tree_budgets(self.tree_budget), default=0)  # the tree rows' choice
            check_drafting(greedy, tree_budget=budget, tree_floor=self.tree_floor, spell=CONFIG)
            check_settings(CONFIG, method="autoregressive", compile=self.compile)  # AR pass's
            if self.temperature <= 0:  # a config's temperature is a number > 0, greedy or not
                CONFIG.refuse("temperature", self.temperature, "; allowed: a number > 0")


@dataclass(frozen=True)
class SpecBench(_Evaluator):
    """``prompts=spec_bench`` (configs/prompts/spec_bench.yaml); ``path`` is relative to the
    project root, as ``draft=`` is."""

    name: Any = setting(None, choice("spec_bench"))
    path: Any = None
    categories: Any = setting(None, names("prompts.categories=[writing,translation]", "categories"))
    per_category: Any = setting(None, integer(1, True, "null or an integer >= 1"))
    turns: Any = setting(None, integer(1, True, "null or an integer >= 1"))

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise EvalConfigError(
                f"prompts.path={self.path!r} is not allowed; allowed: a Spec-Bench "
                "question.jsonl (prompts=spec_bench prompts.path=<file>)"
            )


@dataclass(frozen=True)
class EvalPrompts(_Evaluator):
    """Which prompts are decoded; ``spec_bench`` None: the data group's."""

    # prompts=spec_bench: null takes every question of the file
    num_prompts: int | None = setting(8, integer(1, null=True), error=ConfigError)
    num_prompt_sets: int = setting(1, integer(1), error=ConfigError)
    english_only: bool = setting(True, BOOLEAN)
    sources: Any = setting(None, names("sources=[synthetic/multi_answer]", "source names"))
    max_prompt_length: int | None = setting(None, integer(1, null=True))
    spec_bench: SpecBench | None = section(SpecBench, "prompts", optional=True)

    def __post_init__(self) -> None:
        if self.num_prompts is None and self.spec_bench is None:
            raise ConfigError("num_prompts is missing; allowed: an integer >= 1")
        if self.spec_bench is None:
            return
        if self.sources is not None:
            raise EvalConfigError(
                "sources= is not allowed with prompts=spec_bench (it selects the data group's "
                "sources); allowed: sources=null, and prompts.categories=[...] for Spec-Bench"
            )
        if self.english_only is True:
            raise EvalConfigError(
                "english_only=true is not allowed with prompts=spec_bench (its questions are "
                "taken as they are); allowed: false, and prompts.categories=[...] to choose "
                "questions"
            )


@dataclass(frozen=True)
class EvalRun(_Evaluator):
    """How the passes run and are timed; ``batch_size`` > 1 is part of the folder's identity
    (the times are a batch's shares)."""

    device: str = "cpu"
    num_threads: int | None = setting(1, integer(1, null=True))
    warmup: int = setting(1, integer(0, null=True))
    warmup_window: bool = setting(True, OPTIONAL_BOOLEAN)
    max_throughput: bool = setting(True, BOOLEAN)
    interleave: bool = setting(False, OPTIONAL_BOOLEAN)
    progress: bool = setting(True, OPTIONAL_BOOLEAN)
    batch_size: int = setting(1, BATCH_SIZE)

    def __post_init__(self) -> None:
        device = str(self.device)
        if device != "cpu" and not device.startswith("cuda"):
            raise EvalConfigError(f"device={device!r} is not allowed; allowed: cpu, cuda, cuda:<i>")
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise EvalConfigError(
                    f"device={device!r} is not allowed: CUDA is not available; allowed: cpu"
                )


@dataclass(frozen=True)
class EvalOutput(_Evaluator):
    """Where the records and tables go; relative paths start at ``root_dir``
    (``paths.root_dir``); ``output_dir`` None also when it cannot resolve (``${hydra:...}``
    outside a Hydra run)."""

    root_dir: Path = setting(PROJECT_ROOT, key="paths.root_dir", or_default=True, convert=Path)
    output_dir: str | None = setting(
        None, lenient=True, convert=lambda v: None if v is None else str(v)
    )
    report: Any = None
    resume: str = setting("auto", choice("auto", "force", "never", null=True))
    plots: bool = setting(True, BOOLEAN)


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
    fields: Mapping[str, Any] = setting(
        {}, key="", convert=lambda v: v if isinstance(v, Mapping) else {}
    )

    def check(self, greedy: bool) -> None:
        """Its fields as ``generate_hetero`` checks them, and its model."""
        from mtpc.evaluation.drafters import FIXTURE_PREFIX, FIXTURES

        hetero = {
            name: value
            for name in ("algorithm", "lookahead", "look_behind", "max_psi_paths", "psi")
            if (value := self.fields.get(name)) is not None or name == "algorithm"
        }
        with refusing(EvalConfigError):
            check_settings(Spelling(lambda f: f"drafter.{f}", config=True), greedy=greedy, **hetero)
        model = str(self.model)
        fixtures = ", ".join(FIXTURE_PREFIX + f for f in FIXTURES)
        allowed = f"allowed: a local HF causal-LM folder or {fixtures}"
        fixture = model.startswith(FIXTURE_PREFIX)
        if fixture and model.removeprefix(FIXTURE_PREFIX) not in FIXTURES:
            raise EvalConfigError(f"drafter.model={model!r} is not allowed; {allowed}")
        if not fixture and not Path(model).expanduser().is_dir():
            raise EvalConfigError(f"drafter.model={model!r} does not exist; {allowed}")


@dataclass(frozen=True)
class EvalSettings:
    """Everything an evaluation reads from its config, read and checked once
    (:meth:`from_cfg`). ``given``: the settings of :data:`IDENTITY_FIELDS` as the config gives
    them (None where missing): the manifest records exactly these, so a folder written before
    this settings layer resumes."""

    draft: Any = None
    baseline: Any = None
    model: ModelSettings = section(ModelSettings, "model")
    data: Mapping[str, Any] | None = setting(None, checked_as(DataChecks))
    decoding: EvalDecoding = section(EvalDecoding)
    prompts: EvalPrompts = section(EvalPrompts)
    run: EvalRun = section(EvalRun)
    output: EvalOutput = section(EvalOutput)
    drafter: Drafter | None = section(Drafter, "drafter", optional=True)
    given: Mapping[str, Any] = computed({})

    def __post_init__(self) -> None:
        """The rules across sections: the batch against the target and the drafter."""
        batch_size = self.run.batch_size
        check_batch(batch_size, str(self.model.name), EvalConfigError)
        if self.drafter is None:
            return
        if batch_size > 1:
            raise EvalConfigError(
                f"batch_size={batch_size} is not allowed with drafter= (another vocabulary's "
                "drafter decodes one prompt at a time); allowed: batch_size=1"
            )
        self.drafter.check(self.decoding.greedy)
        spec = self.prompts.spec_bench
        if spec is not None and spec.turns != 1:
            raise EvalConfigError(
                "drafter=hetero decodes one turn per prompt; with prompts=spec_bench set "
                "prompts.turns=1 (allowed: 1)"
            )

    @classmethod
    def from_cfg(cls, cfg: Any) -> EvalSettings:
        """Every field the evaluation uses, checked (target, data and counts:
        ``ConfigError``; the evaluator's own fields: :class:`EvalConfigError`)."""
        return read(cls, cfg, given=given(cfg, IDENTITY_FIELDS))


# ``evaluate``'s door: the config read and checked once, before anything loads
parse_eval = EvalSettings.from_cfg


def explicit_model_fields(overrides: list[str], cfg: Any) -> dict[str, Any]:
    """The ``model.*`` fields a command line sets (``model=<group>`` sets ``name``), with the
    values ``cfg`` composed for them; ``overrides``: Hydra's task overrides, e.g.
    ``["draft=d", "model=evabyte", "model.path=/ckpt"]``."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    keys = ["model.name" if k == "model" else k for k in keys if k.startswith("model")]
    return {k.removeprefix("model."): v for k, v in given(cfg, tuple(keys)).items()}


def hydra_model_overrides(cfg: Any) -> dict[str, Any] | None:
    """The ``model.*`` fields of this Hydra run's command line; ``None`` outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return explicit_model_fields(list(HydraConfig.get().overrides.task), cfg)
