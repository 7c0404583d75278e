"""Request fuzzing: every RPC of every service, with requests generated from its message descriptor.

A third account (the fuzzer, holding one of everything) sends, for each RPC, its valid request with each field in
turn changed to each hostile value (strategies.mutations), then `scale.fuzz_examples` whole requests drawn by
hypothesis (strategies.request), whose references draw from its own objects and from account A's.
Every answer must be OK or a client error (rpcs.CLIENT_ERRORS): never INTERNAL, UNKNOWN, UNAVAILABLE or a deadline
(the service hung), and no message may carry SQL or a stack trace. A's stored rows are unchanged after each RPC's
cases. Generation is derandomized in the short form (the same cases every run) and random in the soak form.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.reliability.figures import FIGURES
from tests.reliability.references import ref_fields, values
from tests.reliability.rpcs import CLIENT_ERRORS, all_rpcs, invoke
from tests.reliability.snapshot import diff
from tests.reliability.strategies import mutations, request
from tests.reliability.templates import DESTRUCTIVE, Requests
from tests.reliability.world import BASE, build_account
from trainyard.v1 import common_pb2
from trainyard.v1 import scheduler_pb2 as spb
from trainyard.v1 import scheduler_pb2_grpc as sg
from trainyard.v1 import trainer_pb2 as tpb

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

RPCS = all_rpcs()
# What a client must never be shown: database statements, driver errors, Python tracebacks.
INTERNALS = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM)\b|\[SQL|psycopg|sqlalchemy|Traceback|"
                       r"File \"/", re.IGNORECASE)


# RPCs whose answer is what they stored: a NaN or an infinity in it was accepted into the database.
STORES = ("Create", "Plan", "Import", "Publish", "Upload")


def non_finite(messages) -> list[str]:
    """Paths of float fields holding NaN or an infinity, anywhere in the messages."""
    found = []

    def walk(m, path):
        for f, v in m.ListFields():
            here = f"{path}.{f.name}" if path else f.name
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                items = v.items()
                for k, x in items:
                    if isinstance(x, float) and not math.isfinite(x):
                        found.append(f"{here}[{k!r}]={x}")
                    elif hasattr(x, "ListFields"):
                        walk(x, f"{here}[{k!r}]")
            elif f.message_type is not None:
                for i, x in enumerate(v if f.is_repeated else [v]):
                    walk(x, f"{here}[{i}]" if f.is_repeated else here)
            elif f.type in (f.TYPE_FLOAT, f.TYPE_DOUBLE):
                found.extend(f"{here}={x}" for x in (v if f.is_repeated else [v]) if not math.isfinite(x))

    for m in messages:
        walk(m, "")
    return found


@dataclass
class Fuzz:
    cases: int = 0
    codes: Counter = field(default_factory=Counter)
    by_rpc: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    def figures(self) -> dict:
        return {"cases": self.cases, "rpcs": len(self.by_rpc), "codes": dict(self.codes),
                "failing_cases": len(self.failures), "codes_by_rpc": {rpc: dict(codes) for rpc, codes in self.by_rpc.items()}}


FUZZ = Fuzz()


@pytest.fixture(scope="module")
def fuzzer(rstack, stubs, owner):
    return build_account(rstack, stubs, "fuzzer")


# The fuzzer's LoRA session as requests name it; each call gets the live session in its place, so a case that
# kills the session (a defect) does not leave the cases after it only "failed earlier" answers.
SESSION = "@session@"


class LiveSession:
    def __init__(self, stubs, acct):
        self.stubs, self.acct = stubs, acct
        self.id = acct.refs["session"][0]

    def refresh(self) -> None:
        """A new session in place of a closed or failed one."""
        current = self.stubs.trainer.GetSession(tpb.GetSessionRequest(id=self.id), metadata=self.acct.md)
        if current.closed or current.error:
            self.id = self.stubs.trainer.CreateSession(tpb.CreateSessionRequest(
                base_model=BASE, lora=tpb.SessionLora(rank=8)), metadata=self.acct.md).id
            self.acct.refs["session"][0] = self.id  # templates build requests on it

    def resolve(self, req):
        """req with every SESSION in a string field replaced by the live session's id."""
        for m in req if isinstance(req, list) else [req]:
            _replace(m, SESSION, self.id)
        return req


def _replace(m, old: str, new: str) -> None:
    for f, v in m.ListFields():
        entry = f.message_type is not None and f.message_type.GetOptions().map_entry
        if entry and f.message_type.fields_by_name["value"].message_type is not None:
            for x in v.values():
                _replace(x, old, new)
        elif f.message_type is not None and not entry:
            for x in (v if f.is_repeated else [v]):
                _replace(x, old, new)
        elif f.type == f.TYPE_STRING and not f.is_repeated and old in v:
            setattr(m, f.name, v.replace(old, new))


def cancel_jobs(stubs, acct) -> None:
    """Jobs the cases created would keep the only worker busy: cancel the ones still queued or running."""
    jobs = sg.JobServiceStub(stubs.channels["scheduler"])
    for job in jobs.ListJobs(spb.ListJobsRequest(page=common_pb2.PageRequest(page_size=500)),
                             metadata=acct.md).jobs:
        if job.status in (spb.JOB_STATUS_QUEUED, spb.JOB_STATUS_RUNNING):
            try:
                jobs.CancelJob(spb.CancelJobRequest(id=job.id), metadata=acct.md)
            except grpc.RpcError as exc:  # it finished between the listing and the cancel
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise


RESULTS: dict[str, list[str]] = {}


@pytest.mark.parametrize("rpc", RPCS, ids=[r.full for r in RPCS])
def test_requests_get_clear_answers(rpc, fuzzer, owner, stubs, snapshots, scale):
    failures = run_fuzz(rpc, fuzzer, owner, stubs, snapshots, scale)
    assert not failures, f"{len(failures)} of the cases failed:\n" + "\n".join(failures[:20])


def run_fuzz(rpc, fuzzer, owner, stubs, snapshots, scale) -> list[str]:
    """The failures of rpc's cases (run once per RPC); A's rows must be unchanged after them."""
    if rpc.full in RESULTS:
        return RESULTS[rpc.full]
    before = snapshots.take(owner.id)
    channel = stubs.channels[rpc.process]
    timeout = 3.0 if rpc.server_streaming and rpc.name.startswith("Watch") else 60.0
    refs = ref_fields(rpc.input)
    session = LiveSession(stubs, fuzzer)
    session.refresh()
    requests = Requests(stubs, fuzzer)
    mine = {kind: values(fuzzer.refs, kind) for kind in {f.kind for f in refs}}
    mine["session"] = [SESSION] + fuzzer.refs["session"][1:]
    if rpc.name.startswith(DESTRUCTIVE):  # the cases use up fresh objects, not those the later RPCs' cases need
        mine.update({f.kind: [requests.fresh(f.kind)] for f in refs})
    FUZZ.by_rpc.setdefault(rpc.full, Counter())
    failures = []

    def pools(kind: str) -> list[str]:
        extra = [BASE] if kind in ("model", "sample_model") else []
        return mine.get(kind, values(fuzzer.refs, kind)) + extra + values(owner.refs, kind)

    def check(req, label: str = "") -> None:
        out = invoke(channel, rpc, session.resolve(req), fuzzer.md, timeout_s=timeout)
        FUZZ.cases += 1
        FUZZ.codes[out.code] += 1
        FUZZ.by_rpc[rpc.full][out.code] += 1
        what = f"{label} in {short_repr(req)}" if label else short_repr(req)
        if out.code not in CLIENT_ERRORS | {"OK"} or out.details.startswith("Stream removed"):
            failures.append(f"{rpc.full}: {out.code} {out.details[:300]!r} for {what}")
        elif INTERNALS.search(out.details):
            failures.append(f"{rpc.full}: {out.code} shows internals {out.details[:300]!r} for {what}")
        elif out.ok and rpc.name.startswith(STORES) and (bad := non_finite(out.responses)):
            failures.append(f"{rpc.full}: OK, stored the non-finite {bad} for {what}")
        if any(f.kind == "session" for f in refs):
            session.refresh()

    baseline = requests.baseline(rpc)
    for label, req in mutations(rpc, _with_session(baseline, session.id)):
        check(req, label)

    @settings(max_examples=scale.fuzz_examples, derandomize=not scale.soak, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(request(rpc, pools))
    def generated(req):
        check(req)

    try:
        generated()
    finally:
        cancel_jobs(stubs, fuzzer)
    changes = diff(before, snapshots.take(owner.id))
    FUZZ.failures += failures
    FIGURES["fuzz"] = FUZZ.figures()
    RESULTS[rpc.full] = failures
    assert not changes, "A's rows changed:\n" + "\n".join(changes)
    return failures


def _with_session(req, session_id: str):
    """The baseline names the session live at the start; its mutations name SESSION, resolved call by call."""
    for m in req if isinstance(req, list) else [req]:
        _replace(m, session_id, SESSION)
    return req


def short_repr(req, limit: int = 600) -> str:
    text = repr([str(m) for m in req]) if isinstance(req, list) else repr(str(req))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
