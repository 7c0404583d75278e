"""SamplingClient: samples and prompt logprobs from the rollout service, for a model named by a weight-version path,
a base model name or a deployment name (trainyard.training.ServiceClient.create_sampling_client)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard import types
from trainyard.futures import APIFuture
from trainyard.v1 import common_pb2, rollout_pb2

if TYPE_CHECKING:
    from trainyard.training import ServiceClient

WEIGHTS_PREFIX = "trainyard://weights/"


class SamplingClient:
    """Samples from one model: a weight version ("trainyard://weights/<version id>", exactly that version), a base
    model or a deployment. Calls return APIFutures and may run concurrently (the rollout batches them)."""

    def __init__(self, service: ServiceClient, model: str, base_model: str | None = None):
        self.service = service
        self.model = model  # what SampleRequest.model names
        self.model_path = model if model.startswith(WEIGHTS_PREFIX) else None
        self.base_model = base_model

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0) -> APIFuture[types.SampleResponse]:
        if topk_prompt_logprobs:
            raise ValueError("topk_prompt_logprobs: not supported (the rollout returns each prompt token's logprob, "
                             "not the top-k alternatives); use include_prompt_logprobs")
        request = self._request(prompt, sampling_params.to_proto(num_samples, include_prompt_logprobs))
        return APIFuture.from_grpc(self.service.rollout.Sample.future(request, metadata=self.service.metadata),
                                   lambda r: types.SampleResponse.from_proto(r, include_prompt_logprobs))

    async def sample_async(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
                           include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0) -> types.SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs)

    def compute_logprobs(self, prompt: types.ModelInput) -> APIFuture[list[float | None]]:
        """The logprob of every prompt token given the tokens before it (None for the first), from the rollout's
        prompt logprobs (one greedy token is generated and dropped)."""
        request = self._request(prompt, types.SamplingParams(max_tokens=1, temperature=0.0).to_proto(1, True))
        return APIFuture.from_grpc(self.service.rollout.Sample.future(request, metadata=self.service.metadata),
                                   lambda r: [None, *r.prompt_logprobs])

    async def compute_logprobs_async(self, prompt: types.ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_base_model(self) -> str | None:
        return self.base_model

    def _request(self, prompt: types.ModelInput, params: rollout_pb2.SamplingParams) -> rollout_pb2.SampleRequest:
        if not isinstance(prompt, types.ModelInput):
            raise ValueError(f"prompt: must be a ModelInput, got {type(prompt).__name__}")
        if prompt.length == 0:
            raise ValueError("prompt: is empty")
        return rollout_pb2.SampleRequest(model=self.model, tokens=common_pb2.TokenList(tokens=prompt.to_ints()),
                                         params=params)
