"""gRPC adapter for the rollout core. No logic and no try/except here: errors map in the interceptor."""
from __future__ import annotations

import contextlib

import torch

from services.common import calls
from services.common.auth import current_caller
from services.common.protoconv import opt
from services.rollout.sampling_core import LoadedInfo, Prompt, SamplingCore
from services.rollout.engine_core import SequenceDelta
from services.rollout.sampling import SampledSequence, SamplingParams
from trainyard.v1 import rollout_pb2 as pb, rollout_pb2_grpc as rpc

_DEFAULTS = SamplingParams()
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "top_logprobs", "prompt_logprobs",
             "return_router_ids", "ignore_eos")


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    values = {name: opt(p, name) for name in _OPTIONAL}
    return SamplingParams(**{k: getattr(_DEFAULTS, k) if v is None else v for k, v in values.items()},
                          stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), seed=opt(p, "seed"))


def prompt(request: pb.SampleRequest) -> Prompt:
    which = request.WhichOneof("prompt")
    if which == "text":
        return Prompt(text=request.text)
    if which == "tokens":
        return Prompt(tokens=tuple(request.tokens.tokens))
    if which == "messages":
        return Prompt(messages=tuple((m.role, m.content) for m in request.messages.messages))
    return Prompt()


def loaded_model(info: LoadedInfo) -> pb.LoadedModel:
    return pb.LoadedModel(name=info.name, base_model=info.base_model, deployment_id=info.deployment_id,
                          checkpoint_id=info.checkpoint_id, lineage=info.lineage,
                          weight_version_id=info.weight_version_id, weight_version=info.weight_version,
                          weight_error=info.weight_error)


def top_logprobs(top: list[list[tuple[int, float]]]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts]) for alts in top]


def router_ids(ids_TLK: torch.Tensor | None, layers: list[int] | None) -> pb.RouterIds | None:
    if ids_TLK is None:
        return None
    return pb.RouterIds(num_tokens=ids_TLK.shape[0], layers=layers, top_k=ids_TLK.shape[2],
                        dtype=str(ids_TLK.dtype).removeprefix("torch."), ids=ids_TLK.contiguous().numpy().tobytes())


def sampled_sequence(s: SampledSequence, layers: list[int] | None) -> pb.SampledSequence:
    return pb.SampledSequence(tokens=s.tokens, text=s.text, logprobs=s.logprobs, finish_reason=s.finish_reason,
                              top_logprobs=top_logprobs(s.top_logprobs), router_ids=router_ids(s.router_ids, layers))


def sequence_delta(d: SequenceDelta, layers: list[int] | None) -> pb.SequenceDelta:
    return pb.SequenceDelta(index=d.index, tokens=d.tokens, text=d.text, logprobs=d.logprobs,
                            top_logprobs=top_logprobs(d.top_logprobs), finish_reason=d.finish_reason,
                            router_ids=router_ids(d.router_ids, layers))


class RolloutServicer(rpc.RolloutServiceServicer):
    def __init__(self, core: SamplingCore):
        self.core = core

    def Sample(self, request, context):
        caller = current_caller()
        result = self.core.sample(caller.account_id, request.model, prompt(request), sampling_params(request.params),
                                  caller.api_key, calls.current(), min_weight_version=request.min_weight_version,
                                  wait_s=context.time_remaining())
        return pb.SampleResponse(model=result.model, prompt_tokens=result.prompt_tokens,
                                 sequences=[sampled_sequence(s, result.router_layers) for s in result.sequences],
                                 prompt_logprobs=result.prompt_logprobs or [],
                                 weight_version_id=result.weight_version_id)

    def SampleStream(self, request, context):
        caller = current_caller()
        stream = self.core.sample_stream(caller.account_id, request.model, prompt(request),
                                         sampling_params(request.params), caller.api_key,
                                         min_weight_version=request.min_weight_version,
                                         wait_s=context.time_remaining(), cancel=calls.current())
        first = True
        with contextlib.closing(stream.outputs()) as outputs:  # closing early (client gone) aborts the request
            for out in outputs:
                yield pb.SampleStreamResponse(
                    model=stream.model if first else "", prompt_tokens=stream.prompt_tokens if first else [],
                    deltas=[sequence_delta(d, stream.router_layers) for d in out.sequences], done=out.finished,
                    prompt_logprobs=out.prompt_logprobs or [],
                    weight_version_id=stream.weight_version_id if first else "")
                first = False

    def LoadDeployment(self, request, context):
        caller = current_caller()
        return loaded_model(self.core.load_deployment(caller.account_id, request.deployment_id, caller.api_key))

    def UnloadDeployment(self, request, context):
        unloaded = self.core.unload_deployment(current_caller().account_id, request.deployment_id)
        return pb.UnloadDeploymentResponse(unloaded=unloaded)

    def ListLoaded(self, request, context):
        loaded = self.core.list_loaded(current_caller().account_id)
        return pb.ListLoadedResponse(models=[loaded_model(m) for m in loaded])
