"""Names a package imports on first use (PEP 562), so that importing one light module of a package does not load the
heavy ones beside it (torch, the client). Standard library only: the models, kernels and trainyard packages use it."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, namespace: dict, exports: dict[str, str],
                 submodules: tuple[str, ...] = ()) -> Callable[[str], object]:
    """A module __getattr__ for `package`: name -> getattr(import_module(exports[name]), name), cached in the
    package's namespace; a name in submodules is that submodule. Also sets the package's __all__."""

    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    namespace["__all__"] = sorted([*exports, *submodules])
    return __getattr__
