"""Prometheus metrics of every Trainyard process, served at http://<host>:<metrics_port>/metrics (the setting in
services/common/config.py; docker-compose.yml publishes each service's).

Declared here once, observed where the thing happens (counters end in _total when scraped; rate() of a token or
byte counter is tokens/s or bytes/s):

    trainyard_grpc_requests_total{service,method,code}            every RPC a server answered (the interceptor)
    trainyard_grpc_request_duration_seconds{service,method,code}  its wall time, to a stream's last message
    trainyard_jobs{status}, trainyard_job_queue_depth             managed jobs by status; queued ones (scheduler,
                                                                  read from the database at scrape time)
    trainyard_engine_tokens_total{kind=prompt|generated}          rollout engine throughput
    trainyard_kv_cache_blocks{model,state=used|total}             rollout KV cache pools (at scrape time)
    trainyard_weightsync_bytes_total{direction=received|sent}     weight-sync service: published / fetched bytes
    trainyard_weight_fetch_bytes_total{kind=files|delta}          bytes a follower (rollout) fetched
    trainyard_weight_swap_seconds                                 rollout: a followed lineage's new version, from
                                                                  starting its fetch to serving it
    trainyard_training_step_seconds{driver=session|managed}       compute of one optimizer step (its forward and
                                                                  backward passes and the AdamW step)
    trainyard_training_tokens_total{driver}                       tokens trained on (trainer, worker)
    trainyard_gateway_requests_total{route,status}                HTTP requests the Tinker gateway answered
    trainyard_gateway_request_duration_seconds{route,status}      their wall time (a future's work runs after)
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
           600.0)

RPCS = Counter("trainyard_grpc_requests", "RPCs answered, by service, method and status code",
               ["service", "method", "code"])
RPC_SECONDS = Histogram("trainyard_grpc_request_duration_seconds", "Wall time of an RPC, to a stream's last message",
                        ["service", "method", "code"], buckets=SECONDS)
ENGINE_TOKENS = Counter("trainyard_engine_tokens", "Tokens the rollout engine computed: prompt tokens prefilled and "
                        "tokens generated", ["kind"])
WEIGHTSYNC_BYTES = Counter("trainyard_weightsync_bytes", "Weight bytes the weight-sync service received "
                           "(PublishVersion) and sent (FetchVersion)", ["direction"])
WEIGHT_FETCH_BYTES = Counter("trainyard_weight_fetch_bytes", "Weight bytes fetched from the weight-sync service: "
                             "version files or deltas", ["kind"])
WEIGHT_SWAP_SECONDS = Histogram("trainyard_weight_swap_seconds", "A followed lineage's new version, from starting "
                                "its fetch to serving it (fetch, load, switch)", buckets=SECONDS)
TRAINING_STEP_SECONDS = Histogram("trainyard_training_step_seconds", "Compute time of one optimizer step: its "
                                  "forward and backward passes and the AdamW step", ["driver"], buckets=SECONDS)
TRAINING_TOKENS = Counter("trainyard_training_tokens", "Tokens trained on (forward and backward)", ["driver"])
GATEWAY_REQUESTS = Counter("trainyard_gateway_requests", "HTTP requests the Tinker gateway answered, by route and "
                           "status", ["route", "status"])
GATEWAY_SECONDS = Histogram("trainyard_gateway_request_duration_seconds", "Wall time of a Tinker gateway request "
                            "(a future's work runs after its answer)", ["route", "status"], buckets=SECONDS)


def observe_rpc(full_method: str, code: str, seconds: float) -> None:
    """full_method: '/trainyard.v1.TrainerService/OptimStep'."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    RPCS.labels(service, method, code).inc()
    RPC_SECONDS.labels(service, method, code).observe(seconds)


class Gauges(Collector):
    """Gauges read when scraped: read() returns {labels tuple: value} for each metric family it declares."""

    def __init__(self, families: dict[str, tuple[str, list[str]]], read: Callable[[], dict[str, dict]]):
        self.families, self.read = families, read  # name -> (help, label names)

    def collect(self) -> Iterable[Metric]:
        values = self.read()
        for name, (doc, labels) in self.families.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            for key, value in values.get(name, {}).items():
                family.add_metric(list(key), value)
            yield family

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, doc, labels=labels) for name, (doc, labels) in self.families.items()]


_collectors: dict[str, Collector] = {}
_collectors_lock = threading.Lock()


def register(name: str, collector: Collector) -> None:
    """Register a scrape-time collector under name, replacing the one registered before under it (a process that
    builds its service again, as tests do, must not register its gauges twice)."""
    with _collectors_lock:
        old = _collectors.pop(name, None)
        if old is not None:
            REGISTRY.unregister(old)
        REGISTRY.register(collector)
        _collectors[name] = collector


def serve(host: str, port: int):
    """Serve /metrics on (host, port) from a daemon thread; the HTTP server (shutdown() stops it)."""
    server, _thread = start_http_server(port, addr=host)
    return server
