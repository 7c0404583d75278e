"""Isolation sweep: every RPC of every service, called by account B on account A's objects.

For each RPC (read from the proto descriptors) and each field of its request that refers to an object, B sends its
own valid request (tests/reliability/templates.py) with that field set to each of A's objects of the kind, and once
more to a made-up object of the same shape. A's object must be refused exactly as the made-up one is (same code, same
message but for the id), so B learns nothing, not even that it exists; B's own object in the same place must be
found (the control: the request reaches the lookup). RPCs without a reference (lists, WhoAmI, uploads) are called
once. Nothing B is told may hold any of A's ids, names or key prefix beyond what B sent, and at the end A's stored
rows and blobs are unchanged and A's deployments still serve A's weights.
"""
from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest

from services.common.channels import auth_metadata
from services.common.config import TrainyardSettings
from tests.reliability.figures import FIGURES
from tests.reliability.references import BY_FIELD, PLAIN, kind_of, ref_fields, short, string_fields, values
from tests.reliability.rpcs import REFUSALS, Outcome, Rpc, all_rpcs, invoke
from tests.reliability.snapshot import diff
from tests.reliability.templates import Requests
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import scheduler_pb2 as spb
from trainyard.v1 import scheduler_pb2_grpc as sg
from trainyard.v1 import weightsync_pb2 as wpb

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

RPCS = all_rpcs()
HEX = re.compile(r"[0-9a-f]{8,}")
WATCH_S = 3.0  # a watch stream that is still open after this long has answered


@dataclass
class Sweep:
    rpcs: set = field(default_factory=set)
    calls: int = 0
    cross_account_calls: int = 0
    refusals: Counter = field(default_factory=Counter)
    findings: list = field(default_factory=list)

    def figures(self) -> dict:
        kinds = Counter(f.split(":", 1)[0] for f in self.findings)
        return {"rpcs_swept": len(self.rpcs), "rpcs_total": len(RPCS), "calls": self.calls,
                "calls_on_other_accounts_objects": self.cross_account_calls,
                "cross_account_successes": kinds["cross-account success"], "leaks": kinds["leak"],
                "distinguishable_refusals": kinds["distinguishable"], "refusal_codes": dict(self.refusals),
                "findings": len(self.findings)}


SWEEP = Sweep()


def fake_of(value: str) -> str:
    """A made-up reference of the same shape: every hex run replaced by other random hex."""
    return HEX.sub(lambda m: secrets.token_hex(len(m.group()))[:len(m.group())], value)


def normalized(details: str, value: str) -> str:
    out = details.replace(value, "<ref>")
    for h in HEX.findall(value):
        out = out.replace(h, "<hex>")
    return out


def leaks(outcome: Outcome, secrets_: set[str], supplied: list[str]) -> list[str]:
    """A's secrets in what B was told, but for those B sent itself (a "not found" may repeat the id asked for)."""
    text = outcome.text()
    return sorted(s for s in secrets_ if len(s) >= 6 and s in text and not any(s in v for v in supplied))


@pytest.fixture(scope="module")
def sweep_ctx(owner, intruder, stubs, snapshots):
    before = snapshots.take(owner.id, with_blobs=True)
    yield Requests(stubs, intruder), before


def call(stubs, rpc: Rpc, request, acct) -> Outcome:
    timeout = WATCH_S if rpc.server_streaming and rpc.name.startswith("Watch") else 120
    SWEEP.calls += 1
    return invoke(stubs.channels[rpc.process], rpc, request, acct.md, timeout_s=timeout)


def sweep_rpc(rpc: Rpc, owner, intruder, stubs, requests: Requests) -> list[str]:
    findings = []
    where = rpc.full
    fields = ref_fields(rpc.input)
    if not fields:
        out = call(stubs, rpc, requests.build(rpc, {}), intruder)
        if out.code not in REFUSALS | {"OK"}:
            findings.append(f"error: {where} answered {out.code}: {out.details[:300]}")
        if leaked := leaks(out, owner.secrets, []):
            findings.append(f"leak: {where} told B {leaked}")
    for f in fields:
        label = f"{where}({'.'.join(f.path)})"
        for value in values(owner.refs, f.kind):
            SWEEP.cross_account_calls += 1
            real = call(stubs, rpc, requests.build(rpc, {f.path: value}), intruder)
            fake_value = fake_of(value)
            fake = call(stubs, rpc, requests.build(rpc, {f.path: fake_value}), intruder)
            if real.ok and not fake.ok:
                findings.append(f"cross-account success: {label}={value!r} answered OK (a made-up one: "
                                f"{fake.code} {fake.details[:200]})")
            elif real.code != fake.code or normalized(real.details, value) != normalized(fake.details, fake_value):
                findings.append(f"distinguishable: {label}={value!r} answered {real.code} {real.details[:200]!r}, "
                                f"a made-up one {fake.code} {fake.details[:200]!r}")
            elif not real.ok and real.code not in REFUSALS:
                findings.append(f"error: {label}={value!r} answered {real.code} {real.details[:200]!r}")
            if not real.ok:
                SWEEP.refusals[real.code] += 1
            if leaked := leaks(real, owner.secrets, [value]):
                findings.append(f"leak: {label}={value!r} told B {leaked}")
        control = call(stubs, rpc, requests.build(rpc, {f.path: requests.control_value(rpc, f.path, f.kind)}),
                       intruder)
        if control.code not in ("OK", "FAILED_PRECONDITION"):
            findings.append(f"control: {label} with B's own object answered {control.code} "
                            f"{control.details[:200]!r}; the sweep of this field proves nothing")
    return findings


def test_every_request_string_field_is_classified():
    """A field that refers to an object must be swept: a new one is classified in references.py first."""
    unknown = []
    for rpc in RPCS:
        for _, f in string_fields(rpc.input, through_lists=True):
            try:
                kind_of(f)
            except KeyError:
                unknown.append(short(f))
    assert not unknown, f"classify these request fields in tests/reliability/references.py: {sorted(set(unknown))}"
    known = {short(f) for rpc in RPCS for _, f in string_fields(rpc.input, through_lists=True)}
    assert not (set(BY_FIELD) | PLAIN) - known, "references.py names fields no request has any more"


@pytest.mark.parametrize("rpc", RPCS, ids=[r.full for r in RPCS])
def test_other_accounts_objects_are_out_of_reach(rpc, owner, intruder, stubs, sweep_ctx):
    requests, _ = sweep_ctx
    SWEEP.rpcs.add(rpc.full)
    findings = sweep_rpc(rpc, owner, intruder, stubs, requests)
    SWEEP.findings += findings
    FIGURES["isolation"] = SWEEP.figures()
    assert not findings, "\n".join(findings)


def test_the_owner_is_untouched(owner, stubs, snapshots, sweep_ctx):
    """After the whole sweep: A's rows and blobs are as they were, and A's lineage deployments serve A's latest
    versions (no publish, rollback or unload of B's reached them)."""
    _, before = sweep_ctx
    changes = diff(before, snapshots.take(owner.id, with_blobs=True))
    loaded = {m.name: m for m in stubs.rollout.ListLoaded(rpb.ListLoadedRequest(), metadata=owner.md).models}
    for lineage, name in zip(owner.refs["lineage"], owner.refs["deployment_name"][1:]):
        current = stubs.weights.GetLineage(wpb.GetLineageRequest(lineage=lineage), metadata=owner.md).current
        if name in loaded and loaded[name].weight_version_id not in ("", current.id):
            changes.append(f"{name} serves {loaded[name].weight_version_id}, not A's current {current.id}")
    FIGURES["isolation"] = {**SWEEP.figures(), "owner_changes": len(changes)}
    assert not changes, "\n".join(changes)


def _http(port: int, key: str, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_openai_http_endpoint_keeps_accounts_apart(rstack, owner, intruder):
    """The rollout's OpenAI-compatible HTTP endpoint, as the gRPC sweep: B's requests naming A's deployments, weight
    versions and model are answered as for made-up names, and B's model list holds nothing of A's."""
    port = rstack.ports["rollout:8000"]
    findings, calls = [], 0
    status, text = _http(port, intruder.key, "GET", "/v1/models")
    calls += 1
    if status != 200 or (leaked := sorted(s for s in owner.secrets if len(s) >= 6 and s in text)):
        findings.append(f"GET /v1/models: {status}, A's {leaked if status == 200 else text[:200]}")
    for value in values(owner.refs, "sample_model"):
        fake = fake_of(value)
        for method, path, body in (
                ("GET", "/v1/models/{}", None),
                ("POST", "/v1/completions", {"model": "{}", "prompt": "hi", "max_tokens": 1}),
                ("POST", "/v1/chat/completions", {"model": "{}", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]})):
            answers = []
            for v in (value, fake):
                b = {k: (v if x == "{}" else x) for k, x in body.items()} if body else None
                answers.append(_http(port, intruder.key, method, path.format(v), b))
                calls += 1
            (s1, t1), (s2, t2) = answers
            if s1 < 400 or (s1, normalized(t1, value)) != (s2, normalized(t2, fake)):
                findings.append(f"{method} {path.format(value)}: {s1} {t1[:200]!r}; made-up: {s2} {t2[:200]!r}")
    FIGURES["isolation_http"] = {"calls": calls, "findings": len(findings)}
    assert not findings, "\n".join(findings)


def test_default_import_roots_keep_other_accounts_weights_out(rstack, owner, intruder, stubs):
    """The scheduler with model_import_roots left at its default: B may not import what the servers wrote for A."""
    rstack.stop("scheduler")
    rstack.extra_env["TRAINYARD_MODEL_IMPORT_ROOTS"] = "[]"
    try:
        rstack.start("scheduler")
        rstack.wait_ready("scheduler")
        rpc = next(r for r in RPCS if r.full == "ModelService.ImportModel")
        requests = Requests(stubs, intruder)
        findings = []
        for value in owner.refs["model_path"]:
            fake_value = fake_of(value)
            real = call(stubs, rpc, requests.build(rpc, {("path",): value}), intruder)
            fake = call(stubs, rpc, requests.build(rpc, {("path",): fake_value}), intruder)
            if real.ok or (real.code, normalized(real.details, value)) != (fake.code,
                                                                            normalized(fake.details, fake_value)):
                findings.append(f"ImportModel(path={value!r}): {real.code} {real.details[:200]!r}; made-up: "
                                f"{fake.code} {fake.details[:200]!r}")
        assert not findings, "\n".join(findings)
    finally:
        rstack.stop("scheduler")
        del rstack.extra_env["TRAINYARD_MODEL_IMPORT_ROOTS"]
        rstack.start("scheduler")
        rstack.wait_ready("scheduler")


AUTH_RECHECK_S = TrainyardSettings.model_fields["auth_recheck_s"].default  # the stack runs with the default


def test_revoking_a_key_ends_its_open_streams(owner, stubs):
    """A's second key watches A's lineage; once it is revoked, the stream must not deliver A's next version."""
    second = sg.AccountServiceStub(stubs.channels["scheduler"]).CreateApiKey(
        spb.CreateApiKeyRequest(name="watcher"), metadata=owner.md)
    lineage = owner.refs["lineage"][0]
    stream = stubs.weights.WatchLineage(wpb.WatchLineageRequest(lineage=lineage),
                                        metadata=auth_metadata(second.secret), timeout=30)
    first = next(stream)
    sg.AccountServiceStub(stubs.channels["scheduler"]).RevokeApiKey(spb.RevokeApiKeyRequest(id=second.key.id),
                                                                    metadata=owner.md)
    time.sleep(AUTH_RECHECK_S + 1)  # the promise (docs/security.md): an open stream re-checks its key this often
    publish = next(r for r in RPCS if r.full == "WeightSyncService.PublishVersion")
    published = invoke(stubs.channels["weightsync"], publish, Requests(stubs, owner).build(publish, {}), owner.md)
    assert published.ok, published.details
    delivered = []
    with contextlib.suppress(grpc.RpcError):
        for msg in stream:
            delivered.append(msg.current.id)
            if msg.current.id == published.responses[0].id:
                break
    stream.cancel()
    assert first.current.id and published.responses[0].id not in delivered, \
        "the revoked key's stream delivered the version published after the revocation"
