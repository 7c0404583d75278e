"""Trainyard: fine-tune and reinforce open LLMs on your own hardware.

Client: the control plane (datasets, managed jobs, deployments) and sampling. ServiceClient, TrainingClient,
SamplingClient and `trainyard.types`: the Training API, shaped like the Tinker API (docs/training_api.md).

Names are imported on first use, so a service importing the generated stubs (trainyard.v1) loads no client code.
"""

_EXPORTS = {"Client": "trainyard.client", "FieldError": "trainyard.errors", "TrainyardError": "trainyard.errors",
            "APIFuture": "trainyard.futures", "SamplingClient": "trainyard.training",
            "ServiceClient": "trainyard.training", "TrainingClient": "trainyard.training"}
_SUBMODULES = ("types",)


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted([*_EXPORTS, *_SUBMODULES])
__version__ = "0.1.0"
