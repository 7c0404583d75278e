"""gRPC adapter for the rollout core. No logic and no try/except here: errors map in the interceptor."""
from __future__ import annotations

from services.common.auth import current_caller
from services.common.protoconv import opt
from services.rollout.core import LoadedInfo, Prompt, RolloutCore
from services.rollout.sampling import SamplingParams
from trainyard.v1 import rollout_pb2 as pb, rollout_pb2_grpc as rpc

_DEFAULTS = SamplingParams()


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    def get(name: str):
        value = opt(p, name)
        return getattr(_DEFAULTS, name) if value is None else value

    return SamplingParams(temperature=get("temperature"), top_p=get("top_p"), top_k=get("top_k"),
                          max_tokens=get("max_tokens"), stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
                          seed=opt(p, "seed"), n=get("n"))


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
                          checkpoint_id=info.checkpoint_id)


class RolloutServicer(rpc.RolloutServiceServicer):
    def __init__(self, core: RolloutCore):
        self.core = core

    def Sample(self, request, context):
        result = self.core.sample(current_caller().account_id, request.model, prompt(request),
                                  sampling_params(request.params))
        return pb.SampleResponse(model=result.model, prompt_tokens=result.prompt_tokens, sequences=[
            pb.SampledSequence(tokens=s.tokens, text=s.text, logprobs=s.logprobs, finish_reason=s.finish_reason)
            for s in result.sequences])

    def LoadDeployment(self, request, context):
        return loaded_model(self.core.load_deployment(current_caller().account_id, request.deployment_id))

    def UnloadDeployment(self, request, context):
        unloaded = self.core.unload_deployment(current_caller().account_id, request.deployment_id)
        return pb.UnloadDeploymentResponse(unloaded=unloaded)

    def ListLoaded(self, request, context):
        loaded = self.core.list_loaded(current_caller().account_id)
        return pb.ListLoadedResponse(models=[loaded_model(m) for m in loaded])
