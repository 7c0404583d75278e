"""Trainyard: fine-tune and reinforce open LLMs on your own hardware.

Client: the control plane (datasets, managed jobs, deployments) and sampling. ServiceClient, TrainingClient,
SamplingClient and `trainyard.types`: the Training API, shaped like the Tinker API (docs/training_api.md).
"""
from trainyard import types
from trainyard.client import Client
from trainyard.errors import FieldError, TrainyardError
from trainyard.futures import APIFuture
from trainyard.training import SamplingClient, ServiceClient, TrainingClient

__all__ = ["APIFuture", "Client", "FieldError", "SamplingClient", "ServiceClient", "TrainingClient", "TrainyardError",
           "types"]
__version__ = "0.1.0"
