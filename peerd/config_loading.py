"""Loading a configuration: reading a TOML file and building a checked config dataclass from a table of keys.

Shared by the node config (:mod:`peerd.config`) and the run config (:mod:`peerd.run_config`): unknown keys and values
of the wrong type raise :class:`ConfigError` naming the key and the file. Imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
import typing
from dataclasses import fields
from typing import Any, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``key``: the offending key where one is to blame; ``reason``: the message without the file or flag it came
    from (the loader names the flag or variable that set ``key``)."""

    def __init__(self, message: str, key: Optional[str] = None, reason: Optional[str] = None):
        super().__init__(message)
        self.key = key
        self.reason = reason if reason is not None else message


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The TOML file's top-level table. Raises ConfigError if the file is missing or not valid TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def check_keys(cls: type, data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a table of keys, got {type(data).__name__} {data!r}")
    names = {f.name for f in fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(names))})")
    return dict(data)


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "None"
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "")


def _coerce(kind: Any, value: Any, where: str) -> Any:
    """``value`` checked against the annotation ``kind`` (as :func:`typing.get_type_hints` resolves it) and
    normalized (int -> float for float, list -> tuple for tuples); raises ValueError(what is expected)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if kind is type(None):
        if value is None:
            return None
        raise ValueError("None")
    if origin in (typing.Union, types.UnionType):
        for option in args:
            with contextlib.suppress(ValueError):
                return _coerce(option, value, where)
        raise ValueError(" or ".join(_type_name(a) for a in args))
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):  # True is no 1
            return value
        raise ValueError("one of " + ", ".join(map(repr, args)))
    if origin is tuple:
        if isinstance(value, str):  # one string where a list is expected: a list of one
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"a list ({_type_name(kind)})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where) for v in value)
        if args and len(args) != len(value):
            raise ValueError(f"a list of {len(args)} ({_type_name(kind)})")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value)) if args else tuple(value)
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)  # equal configs must print (and hash) alike
        raise ValueError("float")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError("bool")
    if kind in (int, str):
        if isinstance(value, kind) and not isinstance(value, bool):
            return value
        raise ValueError(kind.__name__)
    if dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        raise ValueError(f"a table ({kind.__name__})")
    return value  # an annotation this checker does not know: the class's __post_init__ validates it


def build_config(cls: type, data: Mapping[str, Any], source: str, **extra: Any) -> Any:
    """``cls(**data, **extra)`` after checking keys and value types against the annotations of ``cls`` (resolved
    with :func:`typing.get_type_hints`: ``int``, ``float`` (ints accepted and converted), ``str``, ``bool``,
    ``Optional[...]``/``X | None``, ``tuple[str, ...]`` (a TOML list), ``Literal[...]``); errors name the key and
    ``source``.

    Raises ConfigError (unknown key, wrong type, or a value ``cls.__post_init__`` refuses with ConfigError or
    ValueError)."""
    data = check_keys(cls, data, source)
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name not in data:
            continue
        kind = hints.get(f.name, Any)
        try:
            data[f.name] = _coerce(kind, data[f.name], f.name)
        except ValueError as e:
            value = data[f.name]
            raise ConfigError(f"{source}: {f.name} must be {e}, got {type(value).__name__} {value!r}") from None
    try:
        return cls(**data, **extra)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}", key=e.key, reason=e.reason) from None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
