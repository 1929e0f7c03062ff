"""Environment switches: each read where its docs say, parsed strictly, so a typo fails
with the variable's name instead of silently meaning the default."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["env_flag", "env_json", "env_number", "json_object"]


def env_flag(name: str, default: bool) -> bool:
    """``name`` as on/off: 1/true/on or 0/false/off; unset, empty or ``default`` gives
    ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "default"):
        return default
    if value in ("0", "1", "false", "true", "off", "on"):
        return value in ("1", "true", "on")
    raise ValueError(f"{name}={value!r}: use 1 or 0")


def env_number(name: str, default: float) -> float:
    """``name`` as a number; unset gives ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number") from None


def json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` as a JSON object.

    Raises:
        ValueError: naming ``what``, it is not JSON or not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {text!r}")
    return value


def env_json(name: str) -> dict[str, Any] | None:
    """``name`` as a JSON object; unset or empty gives ``None``."""
    raw = os.environ.get(name, "").strip()
    return json_object(raw, name) if raw else None
