"""Pickled objects in a checkpoint (each rank's ``app_state``), and the one way to load them.

A root may come from anyone (a shared bucket, an export, an import), and a pickle can
name any callable: loading one with ``torch.load(..., weights_only=False)`` runs what it
names. A checksum does not help, since whoever writes the file writes its checksum. So
every pickle read out of a root goes through :func:`load_object`: PyTorch's
``weights_only`` unpickler, which builds tensors, numbers, strings and plain containers
and refuses every other global, plus the types the user lists (``CheckpointConfig.
safe_globals``). A refused pickle raises :class:`~torchrec_cnr.errors.UnsafeObjectError`
naming every type it wanted, before anything is built from it.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torchrec_cnr.errors import UnsafeObjectError

__all__ = [
    "SAFE_GLOBALS_OPTION",
    "check_app_state",
    "load_object",
    "resolve_globals",
    "serialize_app_state",
]

SAFE_GLOBALS_OPTION = "CheckpointConfig.safe_globals"
"""Where a user lists the types beyond the built-in ones that ``app_state`` may hold."""


def check_app_state(app_state: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming an ``app_state`` object that cannot be saved and loaded."""
    for name, obj in app_state.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"app_state[{name!r}] needs state_dict() and load_state_dict()")


def serialize_app_state(app_state: Mapping[str, Any]) -> bytes:
    """``torch.save`` of ``{name: obj.state_dict()}``; stored as one object per rank."""
    buf = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in app_state.items()}, buf)
    return buf.getvalue()


def resolve_globals(names: Iterable[str | type]) -> list[Any]:
    """The objects named ``"package.module.Name"`` (a type passes as it is).

    Raises:
        ValueError: a name does not resolve; the message names it and the option.
    """
    out: list[Any] = []
    for name in names:
        if not isinstance(name, str):
            out.append(name)
            continue
        # The longest importable prefix is the module; the rest are attributes (Outer.Inner).
        parts = name.split(".")
        obj: Any = None
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:]:
                obj = getattr(obj, part, None)
            break
        if obj is None:
            raise ValueError(f"{SAFE_GLOBALS_OPTION}: cannot import {name!r}")
        out.append(obj)
    return out


def load_object(blob: bytes, allowed: Iterable[Any], what: str) -> Any:
    """Unpickles ``blob`` (written by ``torch.save``) running no code it names.

    Args:
        blob: the pickled bytes.
        allowed: types and functions the pickle may use beyond tensors, numbers,
            strings and plain containers (see :func:`resolve_globals`).
        what: the object's name in messages (``"app_state of rank 1"``).

    Raises:
        UnsafeObjectError: the pickle names a global that is not allowed; the message
            lists every such global and the option that allows them. Nothing of it ran.
    """
    allowed = list(allowed)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        try:  # every global it names, read without running any of them
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
        except Exception:
            unsafe = []
        known = {f"{getattr(a, '__module__', '')}.{getattr(a, '__qualname__', a)}" for a in allowed}
        refused = [g for g in unsafe if g not in known]
        named = ", ".join(refused) if refused else "a global it is not allowed to load"
        raise UnsafeObjectError(
            f"{what} needs {named}: a restore runs no code from a checkpoint, and only "
            f"tensors, numbers, strings, plain containers and the types listed in "
            f"{SAFE_GLOBALS_OPTION} load; list these types there if you trust this root "
            f"(the unpickler said: {str(e).splitlines()[0]})"
        ) from None
