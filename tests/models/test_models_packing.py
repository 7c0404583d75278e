"""Sequence packing: one packed row (kernels.attention.Packing) trains exactly like its sequences run one by one.

Models: the locally built tiny Qwen3 model (models.tiny.build_tiny_model) and a tiny random Llama (GQA, biases,
llama3 rope scaling; tests/models/conftest.py). Tolerance (float32, CPU): each sequence's summed NLL within
1e-5 relative, and every parameter gradient of the summed loss within 1e-5 of the unpacked one relative to that
gradient's largest entry.
"""
# Shapes: T packed tokens, V vocab.

import importlib

import pytest
import torch
import torch.nn.functional as F

from kernels import Packing
from kernels.logprobs import IGNORE_INDEX
from models import load_pretrained
from services.trainer.engine.logprobs import target_nll_sum

pytestmark = pytest.mark.usefixtures("one_thread")

NLL_RTOL = 1e-5
GRAD_RTOL = 1e-5
LENGTHS = [11, 1, 6, 17]  # uneven, with a one-token sequence (no target of its own, but it must not leak)

attention_module = importlib.import_module("kernels.attention")


@pytest.fixture(scope="module")
def models(tiny_model_dir, hf_model_dirs):
    return {"tiny": load_pretrained(tiny_model_dir), "llama": load_pretrained(hf_model_dirs["llama"][0])}


def _sequences(vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=gen) for n in LENGTHS]


def _seq_nll(logits_TV: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_TV[:-1], ids_T[1:], reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _compare(packed_nll, packed_grads, alone_nll, alone_grads):
    for got, want in zip(packed_nll, alone_nll):
        assert abs(got - want) <= NLL_RTOL * max(abs(want), 1e-30), (got, want)
    assert packed_grads.keys() == alone_grads.keys()
    worst = 0.0
    for name, want in alone_grads.items():
        rel = ((packed_grads[name] - want).abs().max() / want.abs().max()).item()
        worst = max(worst, rel)
        assert rel <= GRAD_RTOL, f"{name}: relative grad diff {rel:.3g}"
    return worst


@pytest.mark.parametrize("backend, group_tokens", [("sdpa", None), ("sdpa", 8), ("reference", None)],
                         ids=["sdpa", "sdpa-grouped", "reference"])
@pytest.mark.parametrize("family", ["tiny", "llama"])
def test_packed_losses_and_grads_equal_unpacked(models, family, backend, group_tokens, monkeypatch):
    monkeypatch.setenv("TRAINYARD_ATTENTION_BACKEND", backend)
    if group_tokens is not None:  # several SDPA calls per row: 11 alone, [1, 6] together, 17 alone
        monkeypatch.setattr(attention_module, "SDPA_PACKED_CHUNK_TOKENS", group_tokens)
    model = models[family]
    model.zero_grad(set_to_none=True)
    seqs = _sequences(model.args.vocab_size)

    alone_nll = []
    for ids_T in seqs:
        nll = _seq_nll(model(ids_T[None])[0], ids_T)
        nll.backward()
        alone_nll.append(nll.item())
    alone_grads = _grads(model)

    packing = Packing.from_lengths(LENGTHS)
    logits_TV = model(torch.cat(seqs)[None], packing=packing)[0]
    bounds = packing.cu_seqlens.tolist()
    packed = [_seq_nll(logits_TV[s:e], ids_T) for s, e, ids_T in zip(bounds, bounds[1:], seqs)]
    torch.stack(packed).sum().backward()
    worst = _compare([n.item() for n in packed], _grads(model), alone_nll, alone_grads)
    print(f"{family} {backend} groups={group_tokens}: nll {alone_nll}, worst relative grad diff {worst:.3g}")


@pytest.mark.parametrize("family", ["tiny", "llama"])
def test_packed_trainer_loss_equals_unpacked(models, family):
    """The trainer's chunked loss (services/trainer/engine/logprobs.target_nll_sum) over one packed row: targets are
    the next token within each sequence, IGNORE_INDEX at each sequence's last token."""
    model = models[family]
    model.zero_grad(set_to_none=True)
    seqs = _sequences(model.args.vocab_size)
    alone = sum(_seq_nll(model(ids_T[None])[0], ids_T) for ids_T in seqs)
    alone.backward()
    alone_grads = _grads(model)

    targets_T = torch.cat([torch.cat([ids_T[1:], torch.tensor([IGNORE_INDEX])]) for ids_T in seqs])
    packed = target_nll_sum(model, torch.cat(seqs)[None], targets_T[None], chunk_size=7,
                            packing=Packing.from_lengths(LENGTHS))
    packed.backward()
    _compare([packed.item()], _grads(model), [alone.item()], alone_grads)
