"""YAML files and ``a.b=value`` overrides mapped one to one onto frozen config dataclasses.

No logic lives in YAML: every key is a dataclass field, and an unknown key or a
value of the wrong type stops with an error naming its dotted path.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown key or holds an invalid value."""


def _convert(value: Any, tp: Any, path: str) -> Any:
    if isinstance(tp, dataclasses.InitVar):
        tp = tp.type
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path} must be one of {typing.get_args(tp)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return _build(tp, value, f"{path}.")  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return origin(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        _, item = typing.get_args(tp)
        return {k: _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    base = origin or tp  # e.g. Callable[[...], bool]: isinstance takes only the bare type
    if tp is bool and not isinstance(value, bool) or not isinstance(value, base):
        raise ConfigError(f"{path} must be {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def _moved(cls: type, raw: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``raw`` with the keys ``cls.MOVED`` names (an old key -> its dotted place now, under
    the same section) moved there, each with a ``DeprecationWarning``."""
    moved: dict[str, str] = getattr(cls, "MOVED", {})
    if not set(moved) & set(raw):
        return raw
    raw = dict(raw)
    for old, new in moved.items():
        if old not in raw:
            continue
        warnings.warn(
            f"config key {prefix}{old} is deprecated and will be removed in the next release: "
            f"write {prefix}{new}",
            DeprecationWarning,
            stacklevel=4,
        )
        *sections, key = new.split(".")
        node = raw
        for section in sections:
            node[section] = node = dict(node.get(section) or {})
        if key in node:
            raise ConfigError(f"{prefix}{old} and {prefix}{new} are both set: keep {new}")
        node[key] = raw.pop(old)
    return raw


def _build(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    raw = _moved(cls, raw, prefix)
    # Init-only fields too: a deprecated spelling a dataclass still takes (InitVar).
    fields = inspect.signature(cls).parameters
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        names = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ConfigError(f"unknown config key(s) {names}; allowed: {sorted(fields)}")
    kwargs = {k: _convert(v, hints[k], f"{prefix}{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e
    except ValueError as e:
        raise ConfigError(_prefixed(prefix, str(e))) from e


def _prefixed(prefix: str, message: str) -> str:
    """``message`` under ``prefix`` (``checkpoint.io.``), naming its key once where the
    library's message names its section already (``io.threads must ...``)."""
    parent, _, section = prefix.rstrip(".").rpartition(".")
    if section and message.startswith(f"{section}."):
        return f"{parent}.{message}" if parent else message
    return prefix + message


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Applies ``a.b.c=value`` (value parsed as YAML) to a nested dict."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(text)


def load(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Builds ``cls`` from a YAML file (or defaults) and dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        raw = loaded or {}
    for override in overrides:
        apply_override(raw, override)
    return _build(cls, raw)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data, e.g. to store beside results."""
    return dataclasses.asdict(config)
