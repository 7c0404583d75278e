"""Training API datums as the core sees them: a client's datum (plain tensors, converted off the wire by the servicer)
checked against the model and the loss into the engine's Datum. Every error names data[i] and the field."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.trainer.engine import losses
from services.trainer.engine.forward_backward import Datum


@dataclass
class DatumInput:
    """One datum as the client sent it: model input tokens and the loss's inputs, not yet checked."""

    tokens: torch.Tensor  # int64 [T]
    loss_fn_inputs: dict[str, torch.Tensor]


def check_datum(d: DatumInput, index: int, loss_fn: str, vocab_size: int, context_length: int) -> Datum:
    """The datum checked against the model's vocabulary, its context length (max_position_embeddings: positions
    past it have no trained rotary embedding) and the loss; every error names data[index] and the field."""
    where = f"data[{index}]"
    if not d.tokens.numel():
        raise InvalidArgument("model input is empty", field=f"{where}.tokens")
    if len(d.tokens) > context_length:
        raise InvalidArgument(f"{len(d.tokens)} tokens exceed the model's context length {context_length}",
                              field=f"{where}.tokens")
    if int(d.tokens.min()) < 0 or int(d.tokens.max()) >= vocab_size:
        raise InvalidArgument(f"token ids must be in [0, {vocab_size})", field=f"{where}.tokens")
    return Datum(d.tokens, losses.check_datum(loss_fn, d.loss_fn_inputs, len(d.tokens), vocab_size, where=where))
