"""Which implementation of an op runs: one rule for every op in kernels/.

An op offers named backends, always including "reference" (pure torch, the ground truth its tests compare against).
The caller's `backend=` argument wins; when it is "auto" the environment variable TRAINYARD_<OP>_BACKEND (e.g.
TRAINYARD_ATTENTION_BACKEND=sdpa) may force one for the whole process; otherwise "auto" lets the op pick its
fastest backend that supports the inputs. A forced backend that cannot run the inputs is an error, never a silent
fallback, so a benchmark or a numerics check always measures what it names.

Optional GPU libraries are imported lazily, once, and only where they import: a CPU machine without them never
touches them.
"""

import functools
import importlib
import os
from types import ModuleType

AUTO = "auto"


def env_var(op: str) -> str:
    return f"TRAINYARD_{op.upper()}_BACKEND"


def requested_backend(op: str, backend: str, choices: tuple[str, ...]) -> str:
    """The backend asked for: the argument, else (when it is "auto") the op's environment variable, else "auto"."""
    if backend == AUTO:
        backend = os.environ.get(env_var(op), AUTO).strip().lower() or AUTO
        source = f"the environment variable {env_var(op)}"
    else:
        source = "the backend argument"
    if backend != AUTO and backend not in choices:
        raise ValueError(f"Unknown {op} backend {backend!r} from {source}; choose one of {(AUTO, *choices)}")
    return backend


@functools.cache
def optional_module(name: str) -> ModuleType | None:
    """The imported module, or None when it is not installed (e.g. flash_attn on a CPU machine)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
