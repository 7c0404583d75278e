"""The training engine (services/trainer/engine/): its loss against a naive reference, its step, its checkpoints
(engine/checkpoint.py: bitwise resume, refusal without side effects, the earlier layouts), its device / dtype rule,
and that it is the only place that builds or steps an optimizer."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.lora import LoraConfig
from services.trainer.engine import AdamW, TrainingEngine, training_dtype
from services.trainer.engine.checkpoint import CheckpointMismatch, read_checkpoint

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


def _train(engine: TrainingEngine, settings: AdamW, steps: int, first_step: int = 0) -> None:
    for s in range(first_step, first_step + steps):
        ids, targets = _batch(engine.model.args.vocab_size, seed=s)
        engine.nll_sum(ids, targets).backward()
        norm = engine.step(settings)
        assert norm.item() > 0 and all(p.grad is None for p in engine.params)


@pytest.mark.parametrize("lora", [LoraConfig(rank=4, alpha=8.0, dropout=0.1), None], ids=["lora", "full"])
def test_step_moves_only_the_trainable_weights_and_a_checkpoint_resumes_bitwise(tiny_model_dir, tmp_path, lora):
    """Four steps straight vs two steps, save (engine/checkpoint.py), a fresh engine restored from it, two more:
    the same bits (weights, optimizer moments, LoRA dropout's RNG draws, the step count)."""
    settings = AdamW(learning_rate=1e-2 if lora else 1e-4, grad_clip_norm=1.0)
    torch.manual_seed(0)  # LoRA dropout draws from the global generator
    straight = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    frozen = {k: v.clone() for k, v in straight.model.state_dict().items() if "lora" not in k}
    _train(straight, settings, 4)
    if lora is not None:
        assert all(torch.equal(v, straight.model.state_dict()[k]) for k, v in frozen.items())
    torch.manual_seed(0)
    first = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    _train(first, settings, 2)
    first.save(tmp_path / "ckpt", base_model="tiny", progress={"note": "two steps"})
    torch.manual_seed(123)  # whatever the generator holds now, the checkpoint's state replaces it
    resumed = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
    saved = read_checkpoint(tmp_path / "ckpt")
    assert (saved.base_model, saved.lora, saved.optim_steps, saved.progress) == ("tiny", lora, 2, {"note": "two steps"})
    resumed.restore(saved, weights=True, optimizer=True, rng=True)
    assert resumed.steps == 2
    _train(resumed, settings, 2, first_step=2)
    assert resumed.steps == straight.steps == 4
    assert all(torch.equal(p, q) for p, q in zip(resumed.params, straight.params))


def test_a_checkpoint_that_does_not_fit_changes_nothing(tiny_model_dir, tmp_path):
    settings = AdamW(learning_rate=1e-2)
    other = TrainingEngine.load(tiny_model_dir, lora=LoraConfig(rank=2, alpha=2.0), seed=1, optimizer=settings,
                                device="cpu")
    _train(other, settings, 1)
    other.save(tmp_path / "rank2", base_model="tiny", progress={})
    engine = TrainingEngine.load(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8.0), seed=0, optimizer=settings,
                                 device="cpu")
    _train(engine, settings, 1)
    before = [p.clone() for p in engine.params], {k: dict(v) for k, v in engine.optimizer.state.items()}
    with pytest.raises(CheckpointMismatch, match="other shapes"):
        engine.restore(read_checkpoint(tmp_path / "rank2"), weights=True, optimizer=True)
    assert all(torch.equal(p, q) for p, q in zip(engine.params, before[0])) and engine.steps == 1
    assert all(torch.equal(engine.optimizer.state[p]["exp_avg"], before[1][p]["exp_avg"]) for p in engine.params)
    (tmp_path / "empty" / "state").mkdir(parents=True)
    with pytest.raises(CheckpointMismatch, match="not a training state"):
        read_checkpoint(tmp_path / "empty")


def test_states_of_the_earlier_layouts_are_read(tiny_model_dir, tmp_path):
    """A managed job's trainer_state.json + rng_state.pt and a session's session_state.json, as written before the
    one format, restore like the current one."""
    settings = AdamW(learning_rate=1e-2)
    lora = LoraConfig(rank=4, alpha=8.0)
    engine = TrainingEngine.load(tiny_model_dir, lora=lora, seed=3, optimizer=settings, device="cpu")
    _train(engine, settings, 2)
    engine.save(tmp_path / "now", base_model="tiny", progress={})
    targets = list(lora.target_modules)
    sft, session = tmp_path / "sft", tmp_path / "session"
    for root in (sft, session):
        shutil.copytree(tmp_path / "now" / "weights", root / "weights")
        (root / "state").mkdir()
        shutil.copyfile(tmp_path / "now" / "state" / "optimizer.pt", root / "state" / "optimizer.pt")
    shutil.copyfile(tmp_path / "now" / "state" / "rng.pt", sft / "state" / "rng_state.pt")
    hyperparams = {"lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": targets, "seed": 3}
    (sft / "state" / "trainer_state.json").write_text(json.dumps(
        {"step": 2, "total_steps": 9, "epoch": 0.5, "train_examples": 8, "eval_examples": 2,
         "hyperparams": hyperparams, "metrics": {}}))
    (session / "state" / "session_state.json").write_text(json.dumps(
        {"format": "trainyard.session_state.v1", "base_model": "tiny", "full_parameter": False, "seed": 3,
         "optim_steps": 2, "next_seq_id": 7, "lora": {"rank": 4, "alpha": 8.0, "target_modules": targets}}))
    for root, progress in ((sft, {"train_examples": 8}), (session, {"next_seq_id": 7})):
        saved = read_checkpoint(root)
        assert (saved.lora, saved.seed, saved.optim_steps) == (lora, 3, 2)
        assert progress.items() <= saved.progress.items()
        fresh = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=settings, device="cpu")
        fresh.restore(saved, weights=True, optimizer=True, rng=saved.has_rng)
        assert all(torch.equal(p, q) for p, q in zip(fresh.params, engine.params)) and fresh.steps == 2
    assert read_checkpoint(sft).base_model == "tiny"  # from the adapter's base_model_name_or_path


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
