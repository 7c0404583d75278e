"""What the engine is checked against, and helpers to drive it.

The reference: the same model code run over the whole sequence, no KV cache, no batching. The helpers step an
EngineCore directly (no threads), so a test fixes exactly which requests arrive before which step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models import load_pretrained
from models.lora import LoraConfig, apply_lora, save_peft_adapter
from services.rollout.engine import Generation, RequestHandle
from services.rollout.engine_core import EngineConfig, EngineCore
from services.rollout.sampling import SamplingParams

# Small KV pools: every test engine would otherwise reserve the 1 GiB default (of address space; pages are touched
# only when written).
SMALL_POOL_MB = 16


def write_adapter(model_dir: Path, out_dir: Path, *, seed: int, b_scale: float) -> Path:
    """A PEFT adapter for a tiny model (default targets: attention, MLPs and, on MoE models, the routed experts):
    A from the seed, B ~ N(0, b_scale) (b_scale 0: B is zeros, as peft initialises it, so the adapter must not
    change the outputs)."""
    model = load_pretrained(model_dir)
    cfg = LoraConfig(rank=4, alpha=8.0)
    params = apply_lora(model, cfg, "default", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora_B in params[1::2]:  # apply_lora returns [A, B] per adapted layer or expert tensor
            lora_B.copy_(torch.randn(lora_B.shape, generator=generator) * b_scale)
    save_peft_adapter(model, cfg, out_dir, str(model_dir))
    return out_dir


@torch.inference_mode()
def naive_logprobs_TV(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a full forward over ids without a cache: row t is the distribution of token t+1."""
    return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def naive_greedy(model, prompt: list[int], max_tokens: int, stop_ids: set[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding by re-running the whole sequence each step (no cache)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        lp_V = naive_logprobs_TV(model, ids)[-1]
        token = int(lp_V.argmax())
        tokens.append(token)
        logprobs.append(float(lp_V[token]))
        ids.append(token)
        if token in stop_ids:
            break
    return tokens, logprobs


@dataclass(frozen=True)
class Arrival:
    """Request `name` joins the engine before step `step` (0 = before the first step)."""

    name: str
    prompt: list[int]
    params: SamplingParams
    step: int = 0
    adapter: str | None = None


@dataclass
class Run:
    results: dict[str, Generation]
    core: EngineCore
    max_batch: int = 0  # most sequences in one step


def make_core(model, tokenizer, **config) -> EngineCore:
    config.setdefault("kv_cache_mb", SMALL_POOL_MB)
    return EngineCore(model, tokenizer, EngineConfig(**config))


def drive(core: EngineCore, arrivals: list[Arrival], stop_ids: frozenset[int] = frozenset()) -> Run:
    """Step the core until every request finished; returns each request's assembled result."""
    handles: dict[str, RequestHandle] = {}
    pending = sorted(arrivals, key=lambda a: a.step)
    run = Run({}, core)
    step = 0
    while pending or core.has_work():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            handles[a.name] = RequestHandle(a.name, a.params.n, cancel=lambda: None)
            core.add_request(a.name, a.prompt, a.params, stop_ids=set(stop_ids), sink=handles[a.name].deliver,
                             adapter=a.adapter)
        core.step()
        run.max_batch = max(run.max_batch, core.last_batch_size)
        step += 1
    run.results = {name: h.result() for name, h in handles.items()}
    return run


def outcome(g: Generation) -> list:
    """Everything a request returns, for exact comparison."""
    seqs = [(s.tokens, s.logprobs, s.top_logprobs, s.text, s.finish_reason,
             None if s.router_ids is None else s.router_ids.tolist()) for s in g.sequences]
    return [seqs, g.prompt_logprobs]


def assert_blocks_all_free(core: EngineCore) -> None:
    blocks = core.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks
    assert all(blocks.refcount(b) == 0 for b in range(blocks.num_blocks))
