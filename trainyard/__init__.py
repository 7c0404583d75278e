"""Trainyard: fine-tune and reinforce open LLMs on your own hardware.

Client: the control plane (datasets, managed jobs, deployments) and sampling. ServiceClient, TrainingClient,
SamplingClient and `trainyard.types`: the Training API, shaped like the Tinker API (docs/training_api.md).

Names are imported on first use, so a service importing the generated stubs (trainyard.v1) loads no client code.
"""

from trainyard.lazy import lazy_exports

_EXPORTS = {"Client": "trainyard.client", "FieldError": "trainyard.errors", "TrainyardError": "trainyard.errors",
            "APIFuture": "trainyard.futures", "SamplingClient": "trainyard.training",
            "ServiceClient": "trainyard.training", "TrainingClient": "trainyard.training"}
_SUBMODULES = ("types",)

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)
__version__ = "0.1.0"
