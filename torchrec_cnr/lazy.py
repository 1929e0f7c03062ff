"""A package's public names imported on first use (PEP 562), so that a process needing one
part of the library (the writer process, ``cnr verify``) does not import TorchRec and
FBGEMM for the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["exports", "listing"]


def exports(namespace: dict[str, Any], homes: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the package whose globals are ``namespace``: a name listed in
    ``homes`` (module -> its names) is imported from that module on first use and kept;
    any other name is not there (so ``from package import submodule`` imports it)."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, namespace["__name__"]), name)
        namespace[name] = value
        return value

    return __getattr__


def listing(namespace: dict[str, Any]) -> Callable[[], list[str]]:
    """The ``__dir__`` of such a package: its globals and every name of its ``__all__``,
    imported or not, so that ``dir()`` and editors' completion show the public names."""
    return lambda: sorted({*namespace, *namespace.get("__all__", ())})
