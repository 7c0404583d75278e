"""The Train page's method choice and plan summary for every method of trainyard.methods.METHODS (no services: the
plan is built as the scheduler would answer it)."""
from __future__ import annotations

from pathlib import Path

from dashboard import logic
from services.common.methods import HYPERPARAMS
from services.scheduler.convert import job_spec
from trainyard.methods import METHODS
from trainyard.v1 import scheduler_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def _plan(method: str, **settings) -> pb.JobPlan:
    spec = job_spec(method, "tiny", "ds_1", "", HYPERPARAMS[method](**settings).to_json())
    return pb.JobPlan(spec=spec, train_rows=16, eval_rows=4, total_steps=8, steps_per_epoch=4, epochs=2.0,
                      checkpoints=2, eval_passes=2, trainable_parameters=100, base_parameters=1000,
                      memory=pb.MemoryEstimate(device="cpu", weights_dtype="float32", total_bytes=2**20))


def test_the_train_page_offers_every_method():
    page = (ROOT / "dashboard" / "pages_train.py").read_text()
    assert 'st.selectbox("Method", list(METHODS)' in page and "dpo" in METHODS


def test_plan_summary_of_a_dpo_job_says_how_it_trains():
    model, dataset = pb.Model(name="tiny", architecture="Qwen3ForCausalLM"), pb.Dataset(name="pairs")
    lora = "\n".join(logic.plan_summary(_plan("dpo", beta=0.2, lora_rank=8), model, dataset))
    assert "a LoRA adapter of rank 8 (alpha 32), by DPO (beta 0.2)" in lora and "of 4 pairs each" in lora
    full = "\n".join(logic.plan_summary(_plan("dpo", full_parameter=True), model, dataset))
    assert "every weight (full-parameter), by DPO (beta 0.1)" in full and "final model" in full
    assert "LoRA" not in full and "adapter" not in full
    sft = "\n".join(logic.plan_summary(_plan("sft"), model, dataset))
    assert "a LoRA adapter of rank 32 (alpha 32):" in sft and "of 4 sequences each" in sft and "DPO" not in sft
