"""Bounded load: `scale.load_sessions` Training API sessions training and `scale.load_samplers` threads sampling at
once, for `scale.load_seconds`, on the tiny model.

Every call must succeed; the p50/p99 latency of each RPC is recorded; the resident memory of every service (its
process group) is taken after a warm-up (allocators and caches settle there) and again at the end, and may grow by at
most `scale.rss_growth_bound` of what it was, plus RSS_SLACK_MB.
"""
from __future__ import annotations

import itertools
import statistics
import threading
import time

import grpc
import pytest

from tests.conftest import create_account
from tests.reliability.chaos import Call, rss_mb
from tests.reliability.figures import FIGURES
from tests.reliability.world import BASE, SEQ, Account, datum, wait_loaded
from trainyard import Client
from trainyard.v1 import common_pb2
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import trainer_pb2 as tpb

pytestmark = [pytest.mark.reliability, pytest.mark.integration, pytest.mark.slow]

WARMUP_S = 5.0
# Below this, growth is allocator and page-cache noise whatever a service's size.
RSS_SLACK_MB = 64.0
SERVICES = ("scheduler", "worker", "trainer", "rollout", "weightsync")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Load:
    """Threads calling in a loop until stopped, each call recorded with its RPC's name."""

    def __init__(self):
        self.calls: list[tuple[str, Call]] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def timed(self, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        self.calls.append((name, Call(t0, time.monotonic(), code)))

    def run(self, body) -> None:
        def loop():
            while not self.stop.is_set():
                body()
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append(t)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def since(self, t: float) -> list[tuple[str, Call]]:
        return [(name, c) for name, c in self.calls if c.started >= t]


def test_sessions_and_samplers_under_load(rstack, stubs, scale):
    acct = Account(name="load", key=create_account(rstack.env_for("scheduler"), "load"))
    md = acct.md
    sessions = [stubs.trainer.CreateSession(tpb.CreateSessionRequest(base_model=BASE, lora=tpb.SessionLora(rank=8),
                                                                     seed=i), metadata=md).id
                for i in range(scale.load_sessions)]
    first = stubs.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sessions[0], name="v0"), metadata=md)
    with Client(url=rstack.url("scheduler"), rollout_url=rstack.url("rollout"), api_key=acct.key) as c:
        deployments = [c.create_deployment("load-fixed", checkpoint_id=first.checkpoint_id).name,
                       c.create_deployment("load-follower", lineage=sessions[0]).name]
    for name in deployments:
        wait_loaded(stubs, acct, name)

    load = Load()

    def training(session: str):
        steps = itertools.count(1)

        def step():
            load.timed("ForwardBackward", lambda: stubs.trainer.ForwardBackward(
                tpb.ForwardBackwardRequest(session_id=session, data=[datum(SEQ)] * 4), metadata=md, timeout=120))
            load.timed("OptimStep", lambda: stubs.trainer.OptimStep(
                tpb.OptimStepRequest(session_id=session, adam=tpb.AdamParams(learning_rate=1e-3)), metadata=md,
                timeout=120))
            n = next(steps)
            if n % 10 == 0:  # the follower deployment hot-loads session 0's versions under load
                load.timed("SaveWeights", lambda: stubs.trainer.SaveWeights(
                    tpb.SaveWeightsRequest(session_id=session, name=f"s{n}"), metadata=md, timeout=120))
        return step

    for session in sessions:
        load.run(training(session))
    for i in range(scale.load_samplers):
        request = rpb.SampleRequest(model=deployments[i % 2], tokens=common_pb2.TokenList(tokens=SEQ[:4]),
                                    params=rpb.SamplingParams(max_tokens=16, temperature=1, seed=i))
        load.run(lambda request=request: load.timed("Sample", lambda: stubs.rollout.Sample(request, metadata=md,
                                                                                           timeout=120)))
    try:
        time.sleep(WARMUP_S)
        before = {s: rss_mb(rstack.procs[s].popen.pid) for s in SERVICES}
        t0 = time.monotonic()
        time.sleep(scale.load_seconds)
        after = {s: rss_mb(rstack.procs[s].popen.pid) for s in SERVICES}
    finally:
        load.finish()
        for session in sessions:
            stubs.trainer.CloseSession(tpb.CloseSessionRequest(id=session), metadata=md)

    measured = load.since(t0)
    errors = sorted({f"{name}: {c.code}" for name, c in load.calls if c.code != "OK"})
    latency = {}
    for name in sorted({n for n, _ in measured}):
        seconds = [c.seconds for n, c in measured if n == name]
        latency[name] = {"calls": len(seconds), "p50_ms": round(percentile(seconds, 50) * 1000, 1),
                         "p99_ms": round(percentile(seconds, 99) * 1000, 1)}
    grown = {s: (before[s], after[s]) for s in SERVICES
             if after[s] > before[s] * (1 + scale.rss_growth_bound) + RSS_SLACK_MB}
    FIGURES["load"] = {"sessions": scale.load_sessions, "samplers": scale.load_samplers,
                       "seconds": scale.load_seconds, "calls": len(load.calls), "errors": len(errors),
                       "latency": latency, "rss_mb_before": {s: round(v) for s, v in before.items()},
                       "rss_mb_after": {s: round(v) for s, v in after.items()},
                       "rss_bound": f"+{scale.rss_growth_bound:.0%} + {RSS_SLACK_MB:.0f} MB"}
    assert not errors, f"calls failed under load: {errors}"
    assert {"ForwardBackward", "OptimStep", "Sample"} <= set(latency), f"a kind of call never completed: {latency}"
    assert not grown, f"resident memory grew past the bound (MB before, after): {grown}"
