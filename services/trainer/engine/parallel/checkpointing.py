"""Activation checkpointing per decoder layer: a layer's forward keeps only its input; backward runs the layer's
forward again to rebuild its activations (non-reentrant torch.utils.checkpoint underneath).

It is applied with torch.distributed's composable `checkpoint(module)`, which installs the recomputation as forward
hooks on the layer and neither wraps nor renames it. checkpoint_wrapper would insert a `_checkpoint_wrapped_module.`
level into every parameter's path; its state-dict hooks hide that from state_dict(), but not from named_modules()
and named_parameters(), which models.lora walks to name PEFT adapter tensors and which the engine uses to name
parameters. With the composable API, state-dict keys, parameter names and PEFT adapter keys stay the Hugging Face
names (tested).

Applied before fully_shard (torchtitan's order): the recomputation then runs inside the layer's FSDP unit, whose
pre-backward hook has gathered the parameters again. The RNG state is saved and restored around the recomputation
(LoRA dropout draws the same masks); MoE routing is recomputed from the same inputs and gives the same experts.
A RouterReplay in "record" mode would record a layer twice (the recomputation routes again): training replays.
"""
from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of model (a CausalLM or a pipeline stage of one) in place; returns how many."""
    layers = list(model.model.layers.values())
    for layer in layers:
        checkpoint(layer)
    return len(layers)
