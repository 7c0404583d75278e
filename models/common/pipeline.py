"""Pipeline stages of a CausalLM: each holds a run of the layers under their original numbers.

A stage is the model with modules removed, never renamed: its state-dict keys are the whole model's
(model.layers.5.self_attn.q_proj.weight stays that on the stage holding layer 5), so checkpoints, PEFT adapter keys,
KV cache layers and router-replay layers mean the same on a stage. The first stage keeps model.embed_tokens, the
last keeps model.norm and lm_head; the others take hidden states [B, T, D] in and give them out (CausalLM.forward).
"""

import copy
from collections.abc import Iterable

from models.common.decoder import CausalLM


def pipeline_stage(model: CausalLM, layer_ids: Iterable[int], *, first: bool, last: bool) -> CausalLM:
    """A copy of model holding the layers layer_ids, the embeddings if first, the final norm and lm_head if last.
    Build the whole model on the meta device to split it without allocating it (as torchtitan does)."""
    keep = {str(i) for i in layer_ids}
    unknown = keep - set(model.model.layers)
    if unknown:
        raise ValueError(f"layers {sorted(map(int, unknown))} are not in this model (it holds {model.layer_ids})")
    stage = copy.deepcopy(model)
    for name in [n for n in stage.model.layers if n not in keep]:
        del stage.model.layers[name]
    if not first:
        stage.model.embed_tokens = None
    if not last:
        stage.model.norm = None
        stage.lm_head = None
    return stage
