"""The job's rollout: the rollout engine (services/rollout/engine.py) in a process of its own, serving the job's
current policy version and hot-loading each new one, so sampling runs beside training (no shared GIL, its own cores).

    rollout = RolloutProcess(model_dir, lora=..., work_dir=..., partial=...)
    rollout.submit(batch, requests)              # queued; batches are sampled one after another, in order
    rollout.update(version, path)                # hot-load version (full weights: a safetensors file of the
                                                 # parameters, written in place between two engine steps; LoRA: a
                                                 # PEFT directory loaded as a new adapter, the previous one
                                                 # unloaded) -- returns at once; the rollout removes path later
    rollout.result(batch) -> (samples, stats)    # waits for that batch

Ordering at a weight update from version v to v + 1 (exact per-token versions): the command is applied between two
batches' requests or in the middle of one: (1) every request in flight is aborted (the engine's inbox runs the abort
before anything queued after it), (2) each aborted sample keeps the tokens it got, all produced by v, as a segment
tagged v, (3) the new weights are written / loaded, (4) the aborted samples are submitted again on v + 1: with
partial_rollouts as prompt + their tokens so far for the tokens left (a new segment tagged v + 1), without it from the
prompt alone (their tokens so far are discarded and counted). A sample's segments give each token's version; a
request submitted at version v runs on v until the next update aborts it.

Each sample is its own request (n = 1) with seed = the request's seed: a sample's draws do not depend on the batch.
The same interface over the platform's rollout and weight-sync services: rollout_service.py.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import AttemptLost

log = logging.getLogger("trainyard.rl.rollout")


@dataclass
class SampleRequest:
    prompt: list[int]
    seed: int


@dataclass
class Segment:
    version: int
    tokens: list[int]
    logprobs: list[float]
    version_id: str = ""  # the weight-sync version the rollout reported (rollout_service.py); "" in process


@dataclass
class Sample:
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str = ""
    router_ids: object = None  # torch.Tensor [P + n - 1, L, K] of the last segment's request (router replay)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]

    @property
    def logprobs(self) -> list[float]:
        return [x for s in self.segments for x in s.logprobs]

    @property
    def token_versions(self) -> list[int]:
        return [s.version for s in self.segments for _ in s.tokens]

    @property
    def versions(self) -> list[int]:
        """The versions that produced its tokens (the first segment's version when it has none)."""
        return sorted({s.version for s in self.segments if s.tokens} or {self.segments[0].version})

    @property
    def version_ids(self) -> list[str]:
        """The weight-sync version ids behind its tokens, oldest first (served by a deployment; else empty)."""
        return list(dict.fromkeys(s.version_id for s in self.segments if s.tokens and s.version_id))


@dataclass
class BatchStats:
    tokens: int  # tokens sampled, discarded ones included
    discarded_tokens: int  # tokens thrown away at a weight update (partial_rollouts off)
    seconds: float  # from the batch's first request to its last sample


class BatchRounds:
    """One batch's samples across request rounds, the same for every backend: a round sends a request for each
    pending sample (continuation: prompt + its tokens so far with partial rollouts, for the tokens left, seeded by
    the request's seed and its segment count); add() folds each answer in (a new segment of its version, or, cut by
    an update without partial rollouts, the tokens discarded and the sample started again); a sample is done at its
    finish reason or at max_tokens."""

    def __init__(self, requests: list[list[SampleRequest]], *, partial: bool, max_tokens: int):
        self.partial, self.max_tokens = partial, max_tokens
        self.flat = [(g, r) for g, group in enumerate(requests) for r in group]
        self.samples = [Sample() for _ in self.flat]
        self.pending = list(range(len(self.flat)))
        self._left: list[int] = []
        self.tokens = self.discarded = 0
        self._groups = len(requests)
        self._start = time.perf_counter()

    def continuation(self, i: int) -> tuple[list[int], int, int]:
        """Sample i's next request: (tokens to send, max_tokens left, seed)."""
        req, s = self.flat[i][1], self.samples[i]
        done = s.tokens if self.partial else []
        return req.prompt + done, self.max_tokens - len(done), req.seed + 7919 * len(s.segments)

    def retry(self, i: int) -> None:
        """Sample i's request was not sent this round: again in the next."""
        self._left.append(i)

    def add(self, i: int, version: int, tokens: list[int], logprobs: list[float], finish_reason: str, router_ids,
            version_id: str = "") -> None:
        s = self.samples[i]
        self.tokens += len(tokens)
        if not self.partial and not finish_reason:  # cut by an update: start again
            self.discarded += len(tokens)
            s.segments = []
            self._left.append(i)
            return
        s.segments.append(Segment(version, list(tokens), list(logprobs), version_id))
        s.router_ids = router_ids
        if finish_reason:
            s.finish_reason = finish_reason
        elif len(s.tokens) >= self.max_tokens:
            s.finish_reason = "length"
        else:
            self._left.append(i)

    def next_round(self) -> None:
        self.pending, self._left = self._left, []

    def result(self) -> tuple[list[list[Sample]], BatchStats]:
        grouped = [[] for _ in range(self._groups)]
        for (g, _), s in zip(self.flat, self.samples):
            grouped[g].append(s)
        return grouped, BatchStats(self.tokens, self.discarded, time.perf_counter() - self._start)


class RolloutLost(AttemptLost):
    """The job's rollout process died (killed, out of memory): the worker retries the job from its last checkpoint."""


class RolloutProcess:
    # False: it loads the base model itself (version 0 is not handed to it), full weights come to update() as a
    # safetensors file of the engine's parameters, and the final version (nothing samples it) is not published.
    serves_lineage = False

    def __init__(self, model_dir: str | Path, *, lora: bool, work_dir: Path, partial: bool, max_tokens: int,
                 temperature: float, router_ids: bool = False, torch_threads: int = 1, device: str | None = None):
        """device: where the rollout engine runs ("cuda:N", "cpu"); None: the trainer's rule (CUDA when there is one,
        else the CPU)."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.proc = ctx.Process(target=_serve, name="rft-rollout", daemon=True, args=(
            child, str(model_dir), lora, partial, max_tokens, temperature, router_ids, torch_threads, device))
        self.proc.start()
        child.close()
        self._results: dict[int, tuple[list[list[Sample]], BatchStats]] = {}
        self.version = 0

    def submit(self, batch: int, requests: list[list[SampleRequest]]) -> None:
        """Queue a batch: per prompt, its group's requests."""
        self._send(("sample", batch, requests))

    def update(self, version: int, weights: Path) -> None:
        """Hot-load a version (module docstring); weights is removed by the rollout once loaded."""
        self._send(("update", version, str(weights)))
        self.version = version

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise self._lost() from exc

    def _lost(self) -> RolloutLost:
        self.proc.join(5)
        return RolloutLost(f"the rollout process exited (status {self.proc.exitcode})")

    def result(self, batch: int) -> tuple[list[list[Sample]], BatchStats]:
        while batch not in self._results:
            if not self.conn.poll(1.0):
                if not self.proc.is_alive():
                    raise self._lost()
                continue
            try:
                kind, *payload = self.conn.recv()
            except (EOFError, ConnectionResetError) as exc:
                raise self._lost() from exc
            if kind == "error":
                raise RuntimeError(f"the rollout process failed: {payload[0]}")
            b, samples, stats = payload
            self._results[b] = (samples, stats)
        return self._results.pop(batch)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.conn.close()


# -- the rollout process -------------------------------------------------------------------------------------------
class _Gate:
    """Who may submit: requests are submitted at the current version; an update aborts those in flight first."""

    def __init__(self):
        self.cv = threading.Condition()
        self.version = 0
        self.adapter: str | None = None
        self.adapter_dir: Path | None = None
        self.updating = False
        self.in_flight: set = set()


def _serve(conn, model_dir: str, lora: bool, partial: bool, max_tokens: int, temperature: float, router_ids: bool,
           torch_threads: int, device: str | None) -> None:
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    from services.rollout.engine import Engine, EngineConfig

    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    try:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"  # the trainer's rule (engine.training_device)
        elif device.startswith("cuda:"):
            torch.cuda.set_device(device)  # kernels that launch on the current device
        engine = Engine(EngineConfig(max_loaded_adapters=4, kv_cache_mb=256, device=device))
        engine.base(model_dir)
        gate = _Gate()
        batches: deque = deque()
        have_batch = threading.Condition()
        stopping = threading.Event()
        worker = threading.Thread(target=_batches, daemon=True, args=(
            engine, model_dir, gate, batches, have_batch, stopping, send, partial, max_tokens, temperature,
            router_ids))
        worker.start()
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "sample":
                with have_batch:
                    batches.append(msg[1:])
                    have_batch.notify()
            elif msg[0] == "update":
                _update(engine, model_dir, gate, lora, msg[1], Path(msg[2]))
        stopping.set()
        with have_batch:
            have_batch.notify()
        engine.close()
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:  # noqa: BLE001 - reported to the job, which fails with it
        send(("error", traceback.format_exc()))


def _update(engine, model_dir: str, gate: _Gate, lora: bool, version: int, weights: Path) -> None:
    from safetensors.torch import load_file

    with gate.cv:
        gate.updating = True
        for handle in list(gate.in_flight):
            handle.cancel()
    try:
        if lora:
            adapter = f"v{version}"
            engine.load_adapter(adapter, model_dir, weights, eager=True)
            old, old_dir = gate.adapter, gate.adapter_dir
            gate.adapter, gate.adapter_dir = adapter, weights
            if old is not None:
                engine.unload_adapter(old)  # no request uses it: those in flight were aborted
                shutil.rmtree(old_dir, ignore_errors=True)
        else:
            engine.update_base_weights(model_dir, load_file(weights))
            weights.unlink()
    finally:
        with gate.cv:
            gate.version = version
            gate.updating = False
            gate.cv.notify_all()


def _batches(engine, model_dir, gate: _Gate, batches: deque, have_batch, stopping, send, partial: bool,
             max_tokens: int, temperature: float, router_ids: bool) -> None:
    from services.rollout.sampling import SamplingParams

    try:
        while True:
            with have_batch:
                while not batches and not stopping.is_set():
                    have_batch.wait()
                if stopping.is_set():
                    return
                batch, requests = batches.popleft()
            rounds = BatchRounds(requests, partial=partial, max_tokens=max_tokens)
            while rounds.pending:
                with gate.cv:
                    while gate.updating:
                        gate.cv.wait()
                    version, adapter = gate.version, gate.adapter
                    handles = []
                    for i in rounds.pending:
                        prompt, left, seed = rounds.continuation(i)
                        params = SamplingParams(temperature=temperature, max_tokens=left, seed=seed,
                                                return_router_ids=router_ids)
                        h = engine.submit(model_dir, adapter, prompt, params)
                        gate.in_flight.add(h)
                        handles.append((i, h))
                for i, h in handles:
                    seq = h.result().sequences[0]
                    with gate.cv:
                        gate.in_flight.discard(h)
                    rounds.add(i, version, seq.tokens, seq.logprobs, seq.finish_reason, seq.router_ids)
                rounds.next_round()
            send(("batch", batch, *rounds.result()))
    except BaseException:  # noqa: BLE001 - reported to the job
        send(("error", traceback.format_exc()))
        os._exit(1)
