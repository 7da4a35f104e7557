"""The settings schema (torch-free): every setting of an entry point declared once, as a field
of a frozen dataclass with its default and its rule, and read from the Hydra config by one
reader, :func:`read`, which checks each value as it reads it (docs/DESIGN.md, "Settings").

A field is ``name: type = setting(default, rule)``; a section nests another schema
(``circuit: CircuitSettings = section(CircuitSettings, "circuit")``); a rule that involves
several fields is the section's ``__post_init__``. A wrong value fails before any model or
dataset loads, in one line naming the field and what is allowed. The schemas:
``mtpc.training.settings`` (train), ``mtpc.evaluation.settings`` (eval, regenerate); the
``model.*`` and ``data.*`` sections they share are here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from mtpc.choices import (
    ATTENTION_IMPLS,
    CODEC_NAMES,
    DTYPE_NAMES,
    EXTRA_POSITIONS,
    HEAD_INITS,
    LORA_TARGET_MODULES,
    MODEL_NAMES,
)
from mtpc.errors import UserError

__all__ = ["EXTRA_POSITIONS", "HEAD_INITS", "ConfigError", "read", "section", "setting"]

_Schema = TypeVar("_Schema")
MISSING: Any = object()
"""A key the config does not have."""
Rule = Callable[[str, Any], None]
"""``rule(key, value)`` raises ``ValueError(<what is allowed>)`` for a bad value."""


class ConfigError(UserError, ValueError):
    """A config value is outside what MTPC accepts; the message names the field."""


class Refused(ValueError):
    """A rule's refusal; its text: what is allowed."""


# ------------------------------------------------------------------------- rules ----
def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def rule(ok: Callable[[Any], bool], allowed: str, null: bool = False) -> Rule:
    """A value ``ok`` accepts (``null``: None too); else ``<key>=<value> is not allowed;
    allowed: <allowed>``."""

    def check(key: str, value: Any) -> None:
        if not ((null and value is None) or ok(value)):
            raise Refused(allowed)

    return check


def integer(low: int, null: bool = False, allowed: str | None = None) -> Rule:
    """An integer >= ``low`` (``null``: or None)."""
    return rule(lambda v: is_integer(v) and v >= low, allowed or f"an integer >= {low}", null)


def number(
    low: float,
    high: float = float("inf"),
    low_open: bool = False,
    high_open: bool = True,
    null: bool = True,
    allowed: str | None = None,
) -> Rule:
    """A number in an interval, e.g. ``(0.0, 1.0]``; None passes unless ``null`` is False."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def ok(v: Any) -> bool:
        return (
            is_number(v)
            and (v > low if low_open else v >= low)
            and (v < high if high_open else v <= high)
        )

    return rule(ok, allowed or f"a number in {interval}", null)


def choice(*allowed: Any, null: bool = False) -> Rule:
    return rule(lambda v: v in allowed, ", ".join(map(str, allowed)), null)


def flag(null: bool = False) -> Rule:
    return rule(lambda v: v is True or v is False, "true, false", null)


def names(example: str, what: str = "names") -> Rule:
    """null, a name or a non-empty list of names; ``example``: the refusal's."""

    def ok(v: Any) -> bool:
        return isinstance(v, str) or (
            isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)
        )

    return rule(ok, f"null or a list of {what}, e.g. {example}", null=True)


def checked_as(schema: type) -> Rule:
    """A whole section kept as given, its fields checked by ``schema`` (read and dropped)."""

    def check(key: str, value: Any) -> None:
        nested = value if isinstance(value, Mapping) else {}
        for part in reversed(key.split(".")):
            nested = {part: nested}
        read(schema, nested, key)

    return check


# ------------------------------------------------------------------------ fields ----
def setting(
    default: Any = None,
    check: Rule | None = None,
    *,
    key: str | None = None,
    or_default: bool = False,
    convert: Callable[[Any], Any] | None = None,
    node: bool = False,
    lenient: bool = False,
    error: type[Exception] | None = None,
    compare: bool = True,
) -> Any:
    """A field read from the config key ``key`` (default: its name; ``""``: the section
    itself) under its section's prefix. A missing key takes ``default`` (``or_default``: a
    null or 0 too); ``check`` refuses a bad value; ``convert`` turns the checked value into the
    field's (a default is the field's already); ``node``: kept as a config node, unresolved
    (for Hydra's ``instantiate``); ``lenient``: a value that cannot resolve outside Hydra
    (``${hydra:...}``) takes the default; ``error``: the refusal's class (default: the
    schema's); ``compare`` False: a record of the config, left out of equality."""
    meta = {
        "check": check,
        "key": key,
        "or_default": or_default,
        "convert": convert,
        "node": node,
        "lenient": lenient,
        "error": error,
    }
    return _field(default, meta, compare)


def _field(default: Any, meta: dict[str, Any], compare: bool = True) -> Any:
    """A dataclass field with ``default`` (a dict or list: a fresh copy each time)."""
    if isinstance(default, dict | list):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata=meta, compare=compare
        )
    return dataclasses.field(default=default, metadata=meta, compare=compare)


def section(schema: type, key: str = "", optional: bool = False) -> Any:
    """A nested schema read from the config section ``key`` (``""``: its parent's keys);
    ``optional``: None when the config has no such section."""
    meta = {"section": schema, "key": key, "optional": optional}
    if optional:
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(default_factory=schema, metadata=meta)


def computed(default: Any = None) -> Any:
    """A field the schema computes (``from_cfg`` passes it to :func:`read`), never read."""
    return _field(default, {"computed": True})


# ------------------------------------------------------------------------ reader ----
def plain(value: Any) -> Any:
    """``value`` as plain Python (a config node resolved to dicts and lists)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def select(cfg: Any, key: str, resolve: bool = True) -> Any:
    """``cfg``'s value at the dotted ``key`` (``""``: ``cfg``), :data:`MISSING` when absent;
    nodes as plain containers unless ``resolve`` is False. The one dotted lookup."""
    if not key:
        value = cfg
    elif isinstance(cfg, DictConfig):  # resolves interpolations of this field only
        value = OmegaConf.select(cfg, key, default=MISSING)
    else:
        value = cfg
        for part in key.split("."):
            if not isinstance(value, Mapping) or part not in value:
                return MISSING
            value = value[part]
    return plain(value) if resolve else value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def read(
    schema: type[_Schema], cfg: Any, prefix: str = "", checked: bool = True, **known: Any
) -> _Schema:
    """``schema`` from ``cfg``'s keys under ``prefix``: each field read, defaulted, checked
    (unless ``checked`` is False: a record, not a user's input) and converted, each section
    read the same way, the computed fields from ``known``; then the schema's own cross-field
    checks (``__post_init__``). Raises the schema's ``error`` (default :class:`ConfigError`)."""
    values: dict[str, Any] = dict(known)
    for item in dataclasses.fields(schema):  # type: ignore[arg-type]
        meta = item.metadata
        if meta.get("computed"):
            continue
        key = _join(prefix, item.name if meta.get("key") is None else meta["key"])
        if "section" in meta:
            given = select(cfg, key, resolve=False)
            if not meta["optional"] or (given is not MISSING and given is not None):
                values[item.name] = read(meta["section"], cfg, key, checked)
            continue
        try:
            value = select(cfg, key, resolve=not meta.get("node"))
        except Exception:
            if not meta.get("lenient"):
                raise
            value = MISSING
        if value is MISSING or (meta.get("or_default") and not value):
            factory = item.default_factory
            values[item.name] = item.default if factory is dataclasses.MISSING else factory()
            continue
        if checked and meta.get("check") is not None:
            try:
                meta["check"](key, value)
            except Refused as refused:
                error = meta["error"] or getattr(schema, "error", ConfigError)
                raise error(f"{key}={value!r} is not allowed; allowed: {refused}") from None
        values[item.name] = meta["convert"](value) if meta.get("convert") else value
    return schema(**values)


def given(cfg: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of ``keys`` as the config gives them (None where missing), plain."""
    return {k: None if (v := select(cfg, k)) is MISSING else v for k in keys}


# -------------------------------------------------------------- shared sections ----
@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The target (``model.*``, ``configs/model/tiny.yaml``'s by default); ``fields``: every
    ``model.*`` field as given (an evaluation's manifest records it as its ``target``)."""

    name: str = setting("tiny", choice(*MODEL_NAMES))
    path: str | None = None  # a local checkpoint or hub id; None: the model's default
    revision: str | None = None
    dtype: str = setting("float32", choice(*DTYPE_NAMES))
    codec: str = setting("tiny", choice(*CODEC_NAMES))
    attention_impl: str = setting("auto", choice(*ATTENTION_IMPLS))  # EvaByte's attention path
    fields: Mapping[str, Any] = setting({}, key="", convert=dict, compare=False)

    def __post_init__(self) -> None:
        path = self.path
        if not isinstance(path, str) or not path:
            return
        # a path rather than a hub id (exactly owner/name, no leading ., / or ~)
        hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and "\\" not in path
        if (self.name == "tiny" or not hub_id) and not Path(path).expanduser().exists():
            raise ConfigError(
                f"model.path={path!r} does not exist; allowed: an existing local checkpoint "
                "folder, a hub id (owner/name; not for model=tiny), or null for the model's "
                "default"
            )

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any] | None) -> ModelSettings:
        """The settings of a ``model`` section (a plain mapping: a draft's record, unchecked)."""
        return read(cls, dict(fields or {}), checked=False)


@dataclasses.dataclass(frozen=True)
class DataChecks:
    """The ``data.*`` fields checked at the door (the section itself is given to the data
    module as it is; None: the data group's own default)."""

    seq_len: int | None = setting(None, integer(1, null=True))
    batch_size: int | None = setting(None, integer(1, null=True))
    max_bytes: int | None = setting(None, integer(1, null=True))
    num_workers: int | None = setting(None, integer(0, null=True))
    validation_fraction: float | None = setting(None, number(0.0, 1.0, low_open=True))
    pack_documents: bool | None = setting(None, flag())


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA on a draft copy of the last layers (``lora.*``, ``configs/lora/default.yaml``;
    recorded in exported drafts); checked against the target's layers when it is attached
    (``mtpc.backbones.lora.validate_lora``)."""

    layers: int = setting(0, integer(0))  # k, the copied layers (0: heads only)
    rank: int = setting(16, integer(1))
    alpha: float = setting(32.0, number(0.0, low_open=True, null=False), convert=float)
    dropout: float = setting(0.0, number(0.0, 1.0, null=False), convert=float)
    target_modules: tuple[str, ...] = setting(LORA_TARGET_MODULES, convert=tuple)

    def to_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}
