"""Trainyard: fine-tune and reinforce open LLMs on your own hardware.

Client: the control plane (datasets, managed jobs, deployments) and sampling. ServiceClient, TrainingClient,
SamplingClient and `trainyard.types`: the Training API, a drop-in for the Tinker SDK (`import trainyard as tinker`;
docs/training_api.md, docs/tinker_compat.md), with Tinker's types also at the top level.

Names are imported on first use, so a service importing the generated stubs (trainyard.v1) loads no client code.
"""

from trainyard.lazy import lazy_exports

_EXPORTS = {"Client": "trainyard.client", "FieldError": "trainyard.errors", "TrainyardError": "trainyard.errors",
            "APIFuture": "trainyard.futures", "RestClient": "trainyard.rest_client",
            "SamplingClient": "trainyard.training",
            "ServiceClient": "trainyard.training", "TrainingClient": "trainyard.training",
            **{name: "trainyard.errors" for name in (
                "TinkerError", "APIError", "APIStatusError", "APIConnectionError", "APITimeoutError",
                "BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError", "ConflictError",
                "UnprocessableEntityError", "RateLimitError", "InternalServerError")},
            # Tinker's top-level types (`import trainyard as tinker`; docs/tinker_compat.md)
            **{name: "trainyard.types" for name in (
                "AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "GetInfoResponse",
                "GetServerCapabilitiesResponse", "LoadWeightsResponse", "LoraConfig", "ModelInput", "ModelInputChunk",
                "OptimParams", "OptimStepResponse", "SampleResponse", "SampledSequence", "SamplingParams",
                "SaveWeightsForSamplerResponse", "SaveWeightsResponse", "StopReason", "TensorData", "TensorDtype",
                "Checkpoint", "CheckpointType", "ModelID", "TrainingRun")}}
_SUBMODULES = ("types",)

__getattr__ = lazy_exports(__name__, globals(), _EXPORTS, _SUBMODULES)
__version__ = "0.1.0"
