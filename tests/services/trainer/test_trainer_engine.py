"""The training engine (services/trainer/engine/): its loss against a naive reference, its step, its resume state,
its device / dtype rule, and that it is the only place that builds or steps an optimizer."""
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from models.lora import LoraConfig
from services.trainer.engine import AdamW, TrainingEngine, training_dtype

ROOT = Path(__file__).resolve().parents[3]


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    targets[1, :4] = -100
    return ids, targets


def test_nll_sum_is_the_cross_entropy_of_full_logits(tiny_model_dir):
    """float32 reference: F.cross_entropy(sum) over the model's full [B, T, V] logits; relative 1e-6."""
    for lora in (None, LoraConfig(rank=4, alpha=8.0)):
        engine = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=AdamW(), device="cpu")
        ids, targets = _batch(engine.model.args.vocab_size)
        with torch.no_grad():
            got = engine.nll_sum(ids, targets)
            want = F.cross_entropy(engine.model(ids).float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum")
        assert abs(got.item() - want.item()) <= 1e-6 * want.item(), (lora, got.item(), want.item())


def test_step_moves_only_the_trainable_weights_and_resumes_bitwise(tiny_model_dir):
    settings = AdamW(learning_rate=1e-2, grad_clip_norm=1.0)
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1)

    def train(engine: TrainingEngine, steps: int, first_step: int = 0) -> None:
        for s in range(first_step, first_step + steps):
            ids, targets = _batch(engine.model.args.vocab_size, seed=s)
            engine.nll_sum(ids, targets).backward()
            norm = engine.step(settings)
            assert norm.item() > 0 and all(p.grad is None for p in engine.params)

    torch.manual_seed(0)  # LoRA dropout draws from the global generator
    straight = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    frozen = {k: v.clone() for k, v in straight.model.state_dict().items() if "lora" not in k}
    train(straight, 4)
    assert all(torch.equal(v, straight.model.state_dict()[k]) for k, v in frozen.items())
    # Two steps, the training state and the adapter carried to a fresh engine, two more: the same bits.
    torch.manual_seed(0)
    first = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    train(first, 2)
    state = first.training_state()
    torch.manual_seed(123)  # whatever the generator holds now, the loaded state replaces it
    resumed = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    with torch.no_grad():
        for p, q in zip(resumed.params, first.params):
            p.copy_(q)
    resumed.load_optimizer_state(state["optimizer"])
    resumed.load_rng_state(state["rng"])
    train(resumed, 2, first_step=2)
    assert all(torch.equal(p, q) for p, q in zip(resumed.params, straight.params))


def test_dtype_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert training_dtype(cpu, full_parameter=False) == training_dtype(cpu, full_parameter=True) == torch.float32
    assert training_dtype(cuda, full_parameter=False) == torch.bfloat16
    assert training_dtype(cuda, full_parameter=True) == torch.float32


def test_only_the_engine_builds_or_steps_an_optimizer():
    """One training engine: SFT, Training API sessions and validation step through it, none with a loop of its own."""
    pattern = re.compile(r"torch\.optim\.\w+\(|clip_grad_norm_\(|\.zero_grad\(|optimizer\.step\(")
    offenders = [str(p.relative_to(ROOT)) for folder in ("services", "models", "trainyard", "dashboard")
                 for p in (ROOT / folder).rglob("*.py")
                 if "engine" not in p.relative_to(ROOT).parts and pattern.search(p.read_text())]
    assert offenders == []
