"""KVCache: prefill + decode must reproduce the full forward (reference), within 1e-5 max abs logits in float32."""

import pytest
import torch

from models import KVCache, load_pretrained

ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_pretrained(tiny_model_dir)


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(model):
    ids = _ids(2, 12)
    full = model(ids)
    cache = KVCache.allocate(model.args, batch_size=2, max_len=16, dtype=torch.float32, device="cpu")
    prefill = model(ids[:, :5], cache=cache)
    assert cache.length == 5
    steps = [prefill]
    for t in range(5, 12):
        steps.append(model(ids[:, t : t + 1], cache=cache))
    assert cache.length == 12
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"prefill+decode vs full forward: max abs diff {diff:.3g}")
    assert diff <= ATOL


@torch.no_grad()
def test_chunked_prefill_and_hidden_output(model):
    ids = _ids(1, 10, seed=1)
    full_hidden = model(ids, return_hidden=True)
    cache = KVCache.allocate(model.args, 1, 10, torch.float32, "cpu")
    first = model(ids[:, :4], cache=cache, return_hidden=True)
    second = model(ids[:, 4:], cache=cache, return_hidden=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full_hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(model.logits(full_hidden), model(ids), atol=ATOL, rtol=0)


@torch.no_grad()
def test_select_expands_one_prompt_to_n_samples(model):
    prompt = _ids(1, 6, seed=2)
    cache = KVCache.allocate(model.args, 1, 8, torch.float32, "cpu")
    model(prompt, cache=cache)
    expanded = cache.select(torch.tensor([0, 0, 0]))
    assert expanded.batch_size == 3 and expanded.length == 6
    next_tokens = torch.tensor([[7], [8], [9]])
    step = model(next_tokens, cache=expanded)
    full = model(torch.cat([prompt.expand(3, -1), next_tokens], dim=1))
    torch.testing.assert_close(step[:, 0], full[:, -1], atol=ATOL, rtol=0)
    assert cache.length == 6  # the source cache is untouched


@torch.no_grad()
def test_overflow_is_a_clear_error(model):
    cache = KVCache.allocate(model.args, 1, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="exceeds max_len=4"):
        model(_ids(1, 5), cache=cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_cuda_matches_cpu_reference(tiny_model_dir, model):
    """The same code on CUDA (SDPA's GPU kernels) against the CPU float32 reference: max abs logits diff <= 1e-4."""
    cuda_model = load_pretrained(tiny_model_dir, device="cuda")
    ids = _ids(2, 12, seed=3)
    reference = model(ids)
    full = cuda_model(ids.cuda())
    cache = KVCache.allocate(cuda_model.args, 2, 12, torch.float32, "cuda")
    steps = [cuda_model(ids[:, :6].cuda(), cache=cache)]
    steps += [cuda_model(ids[:, t : t + 1].cuda(), cache=cache) for t in range(6, 12)]
    assert (full.cpu() - reference).abs().max().item() <= 1e-4
    assert (torch.cat(steps, dim=1).cpu() - reference).abs().max().item() <= 1e-4
