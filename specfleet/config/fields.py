"""Declared fields: each knob says once its default, what it means (`doc`) and what it accepts (`check`).

    fusion_width: int = knob(1, "cooperating drafters per request at most (1: no fusion)", check=at_least(1))

`build` reads a YAML mapping into a dataclass by its type hints (scalars, nested sections,
lists of them, optional ones), refusing unknown keys and values of the wrong type; `check_fields`
runs every field's check on a built object (a config made in code). Both name the key path in their errors
(`drafters[1].max_call_tokens: must be at least 1, got 0`). A section marked `flat` (`section(...,
flat=True)`) keeps its keys at its parent's level in YAML (`router.fusion_width`, not
`router.routing.fusion_width`), and is accepted nested under its name too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, field
from typing import Any, Callable


class ConfigError(ValueError):
    pass


class Check:
    """A test on a field's value, with the message a failure gives ({value} / {value!r}: the value)."""

    def __init__(self, test: Callable[[Any], bool], message: str, doc: str = ""):
        self.test, self.message, self.doc = test, message, doc or message.split(", got")[0]

    def __call__(self, value) -> str | None:
        return None if self.test(value) else self.message.format(value=value)


def at_least(n: float) -> Check:
    return Check(lambda v: v >= n, f"must be at least {n}, got {{value}}")


def above(n: float) -> Check:
    return Check(lambda v: v > n, f"must be above {n}, got {{value}}")


def one_of(choices) -> Check:
    return Check(lambda v: v in choices, f"must be one of {', '.join(choices)}, got {{value!r}}")


def required(message: str = "required") -> Check:
    return Check(bool, message, message)


def knob(default=MISSING, doc: str = "", *, check: Callable[[Any], str | None] | None = None, expect: str = "", factory=None):
    """A field with its documentation, its check (value -> error message or None) and, for a
    list or mapping, what a value of the wrong shape is told it should be (`expect`)."""
    metadata = {"doc": doc, "check": check, "expect": expect}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def redefault(base, name: str, default):
    """A subclass's own default for a field of base: its doc and check stay base's, declared once."""
    (inherited,) = [f for f in dataclasses.fields(base) if f.name == name]
    return field(default=default, metadata=inherited.metadata)


def section(cls, doc: str = "", *, flat: bool = False):
    """A nested section; flat: its keys sit at the parent's level in YAML."""
    return field(default_factory=cls, metadata={"doc": doc, "flat": flat})


def is_flat(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("flat"))


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def keys(cls) -> dict[str, tuple[str | None, dataclasses.Field]]:
    """YAML key -> (the flat section holding it or None, its field): what a mapping for cls may say."""
    known: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for f in dataclasses.fields(cls):
        if is_flat(f):
            known.update({k: (f.name, sub) for k, (_, sub) in keys(_hints(cls)[f.name]).items()})
        known[f.name] = (None, f)
    return known


def build(cls, data, path: str):
    """cls from a YAML mapping, every value type-checked; errors name the key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    known = keys(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(k for k, (_, f) in known.items() if not is_flat(f))}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    flat: dict[str, dict] = {}
    for key, value in data.items():
        holder, f = known[key]
        if holder is not None:
            flat.setdefault(holder, {})[key] = value
        elif is_flat(f):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}.{key}: expected a mapping, got {type(value).__name__}")
            flat.setdefault(key, {}).update(value)
        else:
            kwargs[key] = _value(hints[key], value, f"{path}.{key}", f.metadata.get("expect", ""))
            _check(f, kwargs[key], f"{path}.{key}")  # here, to name the key as the file spells it
    for name, values in flat.items():
        nested = name in data
        kwargs[name] = build(hints[name], values, f"{path}.{name}" if nested else path)
    return cls(**kwargs)


_SCALARS = {bool: "true or false", int: "int", float: "float", str: "str"}


def _value(hint, value, where: str, expect: str):
    """value as hint says, or ConfigError(where: expected ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        if hint in _SCALARS and not expect:
            expect = f"expected {_SCALARS[hint]} or null (the default)"
        return _value(hint, value, where, expect)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint in _SCALARS:
        wanted = (int, float) if hint is float else hint
        if not isinstance(value, wanted) or (isinstance(value, bool) and hint is not bool):
            raise ConfigError(f"{where}: {expect or 'expected ' + _SCALARS[hint]}, got {value!r}")
        return float(value) if hint is float else value
    if origin in (list, dict):
        try:
            if origin is list:
                if not isinstance(value, list):
                    raise ConfigError(f"{where}: {expect or 'expected a list'}, got {value!r}")
                return [_value(args[0], v, f"{where}[{i}]", "") for i, v in enumerate(value)]
            if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
                raise ConfigError(f"{where}: {expect or 'expected a mapping'}, got {value!r}")
            return {k: _value(args[1], v, f"{where}.{k}", "") for k, v in value.items()}
        except ConfigError:
            if expect:  # the field says what it wants of the whole value
                raise ConfigError(f"{where}: {expect}, got {value!r}") from None
            raise
    raise TypeError(f"{where}: no reader for {hint}")  # a new field type: teach _value


def check_fields(obj, path: str) -> None:
    """Run every declared check of obj and of its sections, lists and optional sections."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = path if is_flat(f) else f"{path}.{f.name}"
        _check(f, value, where)
        if dataclasses.is_dataclass(value):
            check_fields(value, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_fields(item, f"{where}[{i}]")


def _check(f: dataclasses.Field, value, where: str) -> None:
    check = f.metadata.get("check")
    if check is not None and value is not None:
        message = check(value)
        if message:
            raise ConfigError(f"{where}{message}" if message.startswith(".") else f"{where}: {message}")


def flat_dict(obj) -> dict:
    """obj as YAML would spell it: flat sections' keys at their parent's level."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if is_flat(f):
            out.update(flat_dict(value))
        elif dataclasses.is_dataclass(value):
            out[f.name] = flat_dict(value)
        elif isinstance(value, list):
            out[f.name] = [flat_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def describe(cls, path: str) -> list[str]:
    """One line per YAML key under path: type, default, what it accepts, what it means."""
    lines = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if is_flat(f):
            lines += describe(hint, path)
            continue
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(hint) or inner:
            lines.append(f"{path}.{f.name}: {f.metadata.get('doc', '')}".rstrip(": "))
            lines += describe(hint if dataclasses.is_dataclass(hint) else inner[0], f"{path}.{f.name}")
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        check = f.metadata.get("check")
        accepts = f"; {check.doc}" if isinstance(check, Check) else ""
        name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        lines.append(f"{path}.{f.name} ({name}, default {default!r}{accepts}): {f.metadata.get('doc', '')}")
    return lines
