"""Lazy re-exports for offload's facades (PEP 562).

Contract: `lazy_getattr(package, table)` returns a module `__getattr__` that resolves a public name
through `table` (name -> (module, attribute)) at each use, importing the module on first need and
caching nothing, so a test that patches the deep module changes what the facade hands out.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, table: dict[str, tuple[str, str]]) -> Callable[[str], object]:
    def __getattr__(name: str) -> object:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = table[name]
        return getattr(importlib.import_module(module), attr)

    return __getattr__
