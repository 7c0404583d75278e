"""PlanJob in process (JobCore + its planner child) on SQLite: CreateJob's checks with the same violations, a plan of
the resolved settings, nothing stored; and the servicer's method table."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

from services.common import auth, registry
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import DataLoss, InvalidArgument
from services.common.schema import SHARED_SCOPE, Job
from services.scheduler import convert
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from services.common.ledger import Ledger
from services.scheduler.planner import Planner
from services.scheduler.servicer import _new_job
from trainyard.client import job_spec
from trainyard.v1 import scheduler_pb2 as pb

SAMPLE = Path(__file__).resolve().parents[3] / "examples" / "data" / "sft_demo.jsonl"


def _stores(tmp: Path, tiny_model_dir: Path):
    """(database, account "acme", blob store, dataset store) on SQLite under tmp, the tiny model registered."""
    url = f"sqlite:///{tmp / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    account, _, _ = auth.create_account(db, "acme")
    with db.session() as s:
        registry.register_model(s, SHARED_SCOPE, "tiny", str(tiny_model_dir))
    blobs = BlobStore(tmp / "blobs")
    return db, account, blobs, DatasetStore(db, blobs, 1 << 20)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    db, account, blobs, store = _stores(tmp_path_factory.mktemp("plan"), tiny_model_dir)
    chat, _ = store.upload(account.id, UploadHeader("faq", None, ""), iter([SAMPLE.read_bytes()]))
    dpo, _ = store.upload(account.id, UploadHeader("dpo", None, ""),
                          iter([b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n']))
    planner = Planner(blobs)
    core = JobCore(db, Ledger(db), lambda job_id: None, 0.05, threading.Event(), planner)
    yield core, account.id, chat.id, dpo.id
    planner.close()
    db.dispose()


def jobs_stored(core: JobCore) -> int:
    with core.db.session() as s:
        return s.scalar(select(func.count()).select_from(Job))


def violations(call, req: NewJob) -> list[tuple[str, str]]:
    with pytest.raises(InvalidArgument) as exc:
        call(req)
    return sorted((v.field, v.reason) for v in exc.value.violations)


@pytest.mark.parametrize("config", [
    {"lora_rank": 0, "learning_rate": -1.0, "lr_scheduler": "step"},
    {"max_seq_len": 100_000, "target_modules": ("nope",)},
    {"lora_dropout": 1.5, "eval_fraction": 0.9, "batch_size": 0, "max_seq_len": 4096},
    {"target_modules": ("q proj",), "unknown": 1},
], ids=["bounds", "model", "mixed", "names"])
def test_plan_runs_create_jobs_checks_with_the_same_violations(env, config):
    core, account, chat, _ = env
    req = NewJob("sft", "tiny", chat, "", config)
    planned = violations(lambda r: core.plan(account, r), req)
    assert planned == violations(lambda r: core.create(account, r), req)
    assert all(field.startswith("spec.sft.") for field, _ in planned) and len(planned) == len(config)
    assert jobs_stored(core) == 0


def test_plan_checks_method_model_and_dataset_like_create(env):
    core, account, chat, dpo = env
    for req, field in ((NewJob("", "tiny", chat, "", {}), "spec.method"),
                       (NewJob("sft", "no-such-model", chat, "", {}), "spec.base_model"),
                       (NewJob("sft", "tiny", "", "", {}), "spec.dataset_id"),
                       (NewJob("sft", "tiny", dpo, "", {}), "spec.dataset_id")):
        assert violations(lambda r: core.plan(account, r), req) == violations(lambda r: core.create(account, r), req)
        assert violations(lambda r: core.plan(account, r), req)[0][0] == field
    assert jobs_stored(core) == 0


def test_plan_resolves_the_settings_and_stores_nothing(env):
    core, account, chat, _ = env
    req = _new_job(job_spec("sft", "tiny", chat, lora_rank=8, batch_size=2, epochs=3))
    checked, plan = core.plan(account, req)
    assert (checked.settings.lora_rank, checked.settings.lora_alpha, checked.settings.learning_rate) == (8, 32.0, 1e-4)
    spec = convert.job_spec("sft", "tiny", chat, "", checked.settings.to_json())
    answer = convert.plan(spec, plan)
    assert answer.spec.sft.lora.rank == 8 and answer.spec.sft.lora.alpha == 32 and answer.spec.sft.epochs == 3
    assert list(answer.spec.sft.lora.target_modules)[:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (answer.train_rows, answer.eval_rows, answer.steps_per_epoch, answer.total_steps) == (18, 2, 9, 27)
    assert answer.memory.total_bytes == sum(getattr(answer.memory, k) for k in (
        "weights_bytes", "trainable_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
        "logprob_chunk_bytes"))
    assert jobs_stored(core) == 0


def test_the_servicer_reads_the_method_from_the_table():
    spec = job_spec("sft", "m", "ds", lora_rank=4, lr_scheduler="constant")
    req = _new_job(spec)
    assert (req.method, req.config) == ("sft", {"lora_rank": 4, "lr_scheduler": "constant"})
    assert _new_job(pb.JobSpec(base_model="m")).method == ""  # unspecified: the core names the known methods
    bad = pb.JobSpec(method=pb.JOB_METHOD_SFT, sft=pb.SftConfig(lr_scheduler=42))
    assert _new_job(bad).config == {"lr_scheduler": 42}  # checked by the declaration, naming the field


def test_a_damaged_dataset_is_neither_planned_nor_previewed(tmp_path, tiny_model_dir):
    """The planner child and PreviewDataset read the dataset's blob verified (in the one pass that reads it): flipped
    bytes are DataLoss naming the dataset, never a plan or rows from damaged bytes."""
    db, account, blobs, store = _stores(tmp_path, tiny_model_dir)
    ds, _ = store.upload(account.id, UploadHeader("faq", None, ""), iter([SAMPLE.read_bytes()]))
    planner = Planner(blobs)
    core = JobCore(db, Ledger(db), lambda job_id: None, 0.05, threading.Event(), planner)
    try:
        req = _new_job(job_spec("sft", "tiny", ds.id, lora_rank=8))
        path = blobs.path(ds.sha256)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x20  # a letter's case in the last row: still valid JSON
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        for call in (lambda: core.plan(account.id, req), lambda: store.preview(account.id, ds.id, 0, 1)):
            with pytest.raises(DataLoss, match=f"dataset {ds.id}: blob {ds.sha256} is damaged"):
                call()
        path.write_bytes(SAMPLE.read_bytes())  # repaired: both work again
        assert core.plan(account.id, req)[1]["train_rows"] == 18
        assert len(store.preview(account.id, ds.id, 0, 1)[1]) == 1
    finally:
        planner.close()
        db.dispose()


def _reference_lengths(tiny_model_dir: Path, rows: list[dict]) -> list[int]:
    """Each row's untruncated tokens by models.chat directly (the reference the planner's numbers must equal)."""
    from models.chat import tokenize_preference_response, tokenize_sft_example
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    if "chosen" in rows[0]:
        return [max(len(tokenize_preference_response(tok, r["prompt"], r[k], 1 << 20).input_ids)
                    for k in ("chosen", "rejected")) for r in rows]
    return [len(tokenize_sft_example(tok, r, 1 << 20).input_ids) for r in rows]


def test_token_stats_count_each_row_as_the_trainer_tokenizes_it(env, tiny_model_dir):
    import json
    import math

    core, account, chat, dpo = env
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    lengths = sorted(_reference_lengths(tiny_model_dir, rows))
    model, stats = core.token_stats(account, chat, "tiny", 0)
    assert model.name == "tiny" and stats["rows"] == len(rows) == 20
    assert stats["mean_tokens"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-9)
    assert stats["max_tokens"] == lengths[-1]
    assert stats["p95_tokens"] == lengths[math.ceil(0.95 * len(lengths)) - 1]  # nearest rank
    assert stats["max_seq_len"] == 2048 and stats["over_max_seq_len"] == 0  # SFT's default (tiny's context: more)
    limit = lengths[len(lengths) // 2]
    _, stats = core.token_stats(account, chat, "tiny", limit)
    assert (stats["max_seq_len"], stats["over_max_seq_len"]) == (limit, sum(n > limit for n in lengths))
    _, stats = core.token_stats(account, dpo, "tiny", 0)
    pair = _reference_lengths(tiny_model_dir, [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    assert (stats["rows"], stats["max_tokens"], stats["counted"][:10]) == (1, pair[0], "the longer")
    # RFT rows count their prompt: a plain string as the rollout encodes it, a conversation with the chat template's
    # generation prompt.
    from models.chat import encode_chat_prompt
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    rft_rows = [{"prompt": "What is 2+2?", "answer": 4},
                {"messages": [{"role": "user", "content": "And 3+3, please?"}], "answer": 6}]
    rft = DatasetStore(core.db, core.planner.blobs, 1 << 20).upload(
        account, UploadHeader("rft", None, ""), iter([json.dumps(r).encode() + b"\n" for r in rft_rows]))[0]
    _, stats = core.token_stats(account, rft.id, "tiny", 0)
    expected = [len(tok.encode("What is 2+2?", add_special_tokens=False)),
                len(encode_chat_prompt(tok, rft_rows[1]["messages"]))]
    assert (stats["rows"], stats["max_tokens"]) == (2, max(expected))
    assert stats["mean_tokens"] == pytest.approx(sum(expected) / 2) and stats["counted"].startswith("the prompt")


def test_token_stats_refuse_bad_input_by_field_and_other_accounts_datasets(env):
    from services.common.errors import NotFound

    core, account, chat, _ = env
    for args, field in (((chat, "nope", 0), "base_model"), (("", "tiny", 0), "dataset_id"),
                        ((chat, "tiny", -1), "max_seq_len"), ((chat, "tiny", 10**9), "max_seq_len")):
        with pytest.raises(InvalidArgument) as exc:
            core.token_stats(account, *args)
        assert exc.value.violations[0].field == field
    other, _, _ = auth.create_account(core.db, "other-stats")
    with pytest.raises(NotFound):
        core.token_stats(other.id, chat, "tiny", 0)
