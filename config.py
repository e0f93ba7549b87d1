"""Typed configuration: the one parser behind every config section (recipe tables and `--set` overrides).

A section is a dataclass that subclasses `Section` and names its table in `SECTION`. Field annotations are the
schema: `bool`, `int`, `float`, `str`, `Literal[...]` for a fixed set of choices, `X | None`, `tuple[...]`,
`list[...]` and `dict[str, ...]` of those. Every construction checks every field against its annotation (ints are
accepted for floats, lists for tuples) and then runs the section's own `check()` for ranges and cross-field rules,
so a bad value is refused where it enters, naming section, key, value and what is allowed:

    ConfigError: model.seq_attention = 'relu': must be one of 'softmax', 'silu'

`Section.from_dict(table)` also refuses unknown keys; `parse_override("model.d_model=64")` reads a command-line
override (the value is a TOML literal, else a bare string) and `apply_overrides` merges them into raw tables.
This module imports nothing from gemrec, so every layer (kernels, model, components) can use it.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

S = TypeVar("S", bound="Section")


class ConfigError(ValueError):
    """A config table or value that does not fit its section; the message names what and why."""


def field_error(section: str, key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{section}.{key} = {value!r}: {rule}")


class _Mismatch(Exception):
    """`value` does not fit the annotation; `args[0]` says what would."""


def describe(tp: Any) -> str:
    """What a value of annotation `tp` looks like, for error messages."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("unset ('')" if a is type(None) else describe(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} values ({', '.join(describe(a) for a in args)})"
    if origin is list:
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"a table of {_plural(args[1])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _plural(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "values in " + ", ".join(repr(a) for a in get_args(tp))
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(tp, describe(tp))


def coerce(value: Any, tp: Any) -> Any:
    """`value` checked against annotation `tp` (ints widened to float, lists to tuples); raises `_Mismatch`."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise _Mismatch(describe(tp))
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and (value is None or value == ""):  # TOML has no null: "" means unset
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return coerce(value, option)
            except _Mismatch:
                continue
        raise _Mismatch(describe(tp))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(describe(tp))
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_item(v, args[0], tp) for v in value)
        if len(value) != len(args):
            raise _Mismatch(describe(tp))
        return tuple(_item(v, a, tp) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(describe(tp))
        return [_item(v, args[0], tp) for v in value]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch(describe(tp))
        return {_item(k, args[0], tp): _item(v, args[1], tp) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _Mismatch(describe(tp))


def _item(value: Any, tp: Any, container: Any) -> Any:
    try:
        return coerce(value, tp)
    except _Mismatch:
        raise _Mismatch(describe(container)) from None


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every dataclass field of `cls` (resolved once per class)."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


def choices(cls: type, key: str) -> tuple[Any, ...]:
    """The allowed values of a `Literal` field (for CLI `choices=` and docs)."""
    tp = field_types(cls)[key]
    if get_origin(tp) is not Literal:
        raise TypeError(f"{cls.__name__}.{key} is not a Literal field")
    return get_args(tp)


class Section:
    """Base of the config dataclasses: checked field by field at construction, then by `check()`."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        for key, tp in field_types(type(self)).items():
            value = getattr(self, key)
            try:
                checked = coerce(value, tp)
            except _Mismatch as err:
                raise field_error(self.SECTION, key, value, f"must be {err.args[0]}") from None
            if checked is not value:
                object.__setattr__(self, key, checked)  # also for frozen sections
        self.check()

    def check(self) -> None:
        """Ranges and rules between fields; raise with `self.require`. Sections override it."""

    def require(self, ok: bool, key: str, rule: str) -> None:
        """Refuse the value of `key` unless `ok`; `rule` says what is allowed (e.g. "must be > 0")."""
        if not ok:
            raise field_error(self.SECTION, key, getattr(self, key), rule)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[S], values: Mapping[str, Any] | None) -> S:
        """Build from a recipe table; unknown keys are refused with the keys the section takes."""
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{cls.SECTION}] must be a table of settings, got {values!r}")
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            listed = ", ".join(f"{cls.SECTION}.{k} = {values[k]!r}" for k in unknown)
            raise ConfigError(f"unknown setting {listed}; [{cls.SECTION}] takes {', '.join(sorted(cls.keys()))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value); the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key {key.strip()!r} must be section.key (e.g. train.steps=50)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def apply_overrides(raw: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the raw tables with every `section.key=value` override set."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {text!r}: [{section}] is not a table")
        table[key] = value
    return out


def build_sections(raw: Mapping[str, Any], sections: Mapping[str, type[Section]]) -> dict[str, Section]:
    """Every section of `sections` built from its raw table (absent = defaults); unknown tables are refused."""
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; this takes {', '.join(sections)}")
    return {name: cls.from_dict(raw.get(name)) for name, cls in sections.items()}
