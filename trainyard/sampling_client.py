"""SamplingClient: samples and prompt logprobs from the rollout service, for a model named by a weight-version path,
a base model name or a deployment name (trainyard.training.ServiceClient.create_sampling_client)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainyard import types
from trainyard.errors import TrainyardError
from trainyard.futures import APIFuture, async_twin_signatures
from trainyard.v1 import common_pb2, rollout_pb2

if TYPE_CHECKING:
    from trainyard.training import ServiceClient

WEIGHTS_PREFIX = "trainyard://weights/"


@async_twin_signatures
class SamplingClient:
    """Samples from one model: a weight version ("trainyard://weights/<version id>", exactly that version), a base
    model or a deployment. Calls return APIFutures and may run concurrently (the rollout batches them)."""

    def __init__(self, service: ServiceClient, model: str, base_model: str | None = None,
                 tokenizer: Callable[[], Any] | None = None):
        self.service = service
        self.model = model  # what SampleRequest.model names
        self.model_path = model if model.startswith(WEIGHTS_PREFIX) else None
        self.base_model = base_model
        self._tokenizer = tokenizer  # the TrainingClient's get_tokenizer, for clients made from one

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: types.TensorData | None = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[types.SampleResponse]:
        """Tinker's sample. topk_sample_logprobs = k (<= 20): each sequence's topk_logprobs. Refused before
        sending: topk_prompt_logprobs, target_prompt_logprobs, prompt_alt_tokens_k (the rollout computes none)."""
        if topk_prompt_logprobs:
            raise ValueError("topk_prompt_logprobs: not supported (the rollout returns each prompt token's logprob, "
                             "not the top-k alternatives); use include_prompt_logprobs")
        if target_prompt_logprobs is not None:
            raise ValueError("target_prompt_logprobs: not supported by Trainyard's rollout")
        if prompt_alt_tokens_k:
            raise ValueError("prompt_alt_tokens_k: not supported by Trainyard's rollout")
        last_n = self._last_n(prompt, prompt_logprobs_last_n, include_prompt_logprobs)
        params = sampling_params.to_proto(num_samples, include_prompt_logprobs)
        if topk_sample_logprobs:
            params.top_logprobs = topk_sample_logprobs
        request = self._request(prompt, params)

        def convert(r) -> types.SampleResponse:
            out = types.SampleResponse.from_proto(r, include_prompt_logprobs, bool(topk_sample_logprobs))
            if last_n is not None:
                out.prompt_logprobs = _keep_last(out.prompt_logprobs, last_n)
            return out

        return APIFuture.from_grpc(self.service.rollout.Sample.future(request, metadata=self.service.metadata),
                                   convert)

    async def sample_async(self, *args, **kwargs) -> types.SampleResponse:
        return await self.sample(*args, **kwargs)

    def compute_logprobs(self, prompt: types.ModelInput,
                         prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        """The logprob of every prompt token given the tokens before it (None for the first; with
        prompt_logprobs_last_n = N, None for all but the last N), from the rollout's prompt logprobs (one greedy
        token is generated and dropped)."""
        last_n = self._last_n(prompt, prompt_logprobs_last_n, True)
        request = self._request(prompt, types.SamplingParams(max_tokens=1, temperature=0.0).to_proto(1, True))
        return APIFuture.from_grpc(self.service.rollout.Sample.future(request, metadata=self.service.metadata),
                                   lambda r: _keep_last([None, *r.prompt_logprobs], last_n))

    async def compute_logprobs_async(self, *args, **kwargs) -> list[float | None]:
        return await self.compute_logprobs(*args, **kwargs)

    def get_tokenizer(self):
        """The base model's tokenizer, for a SamplingClient made by a TrainingClient (from its session)."""
        if self._tokenizer is None:
            raise TrainyardError("UNIMPLEMENTED", "get_tokenizer: only a SamplingClient made by a TrainingClient "
                                 "(save_weights_and_get_sampling_client, create_sampling_client) has a tokenizer; "
                                 "use the TrainingClient's get_tokenizer")
        return self._tokenizer()

    def get_base_model(self) -> str | None:
        return self.base_model

    async def get_base_model_async(self) -> str | None:
        return self.base_model

    @staticmethod
    def _last_n(prompt: types.ModelInput, last_n: int | None, include_prompt_logprobs: bool) -> int | None:
        if last_n is None:
            return None
        if not include_prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n: needs include_prompt_logprobs=True")
        length = prompt.length if isinstance(prompt, types.ModelInput) else 0
        if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= length - 1:
            raise ValueError(f"prompt_logprobs_last_n: must be between 1 and len(prompt) - 1 = {length - 1}, got "
                             f"{last_n!r}")
        return last_n

    def _request(self, prompt: types.ModelInput, params: rollout_pb2.SamplingParams) -> rollout_pb2.SampleRequest:
        if not isinstance(prompt, types.ModelInput):
            raise ValueError(f"prompt: must be a ModelInput, got {type(prompt).__name__}")
        if prompt.length == 0:
            raise ValueError("prompt: is empty")
        return rollout_pb2.SampleRequest(model=self.model, tokens=common_pb2.TokenList(tokens=prompt.to_ints()),
                                         params=params)


def _keep_last(logprobs: list[float | None] | None, last_n: int | None) -> list[float | None] | None:
    """Tinker's prompt_logprobs_last_n: entries before the last N are None (the rollout scores them all)."""
    if logprobs is None or last_n is None:
        return logprobs
    return [None] * (len(logprobs) - last_n) + logprobs[-last_n:]
