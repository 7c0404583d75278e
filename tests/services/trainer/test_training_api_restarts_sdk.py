"""The SDK across trainer restarts (trainyard/ordered_calls.py, "Restarts"), against in-process trainer servers
restarted on the same port over one database: a graceful restart in the middle of pipelined calls is invisible to the
client and the session ends bitwise where an undisturbed one does; after a crash the client learns which answered
calls were lost (ABORTED), resumes the same session and ends bitwise equal too; an UNAVAILABLE the trainer answered
itself (a refused publish) leaves the client going on."""
from __future__ import annotations

import threading
import time

import pytest

from api_helpers import ApiEnv
from services.common.auth import issue_key
from services.common.schema import Checkpoint
from services.trainer.app import TrainerSettings, build as build_trainer
from services.weightsync.app import WeightSyncSettings, build as build_weightsync
from trainyard import ServiceClient, TrainyardError, types
from trainyard.localstack import free_port

STEPS = 6


class Platform:
    """One database and blob store; a weight-sync server; a trainer that can be restarted on its port."""

    def __init__(self, root, model_dir, **trainer_settings):
        self.env = ApiEnv(root, model_dir)
        self.key = issue_key(self.env.db, self.env.alice, "test")[1]
        self.common = dict(data_dir=root, database_url=f"sqlite:///{root / 'trainyard.db'}", host="127.0.0.1",
                           grpc_workers=16, shutdown_grace_s=5)
        self.weightsync = build_weightsync(WeightSyncSettings(weightsync_port=0, **self.common))
        self.weightsync.start()
        self.port = free_port()
        self.trainer_settings = TrainerSettings(trainer_port=self.port, micro_batch_tokens=64,
                                                weightsync_url=f"127.0.0.1:{self.weightsync.port}",
                                                **self.common, **trainer_settings)
        self.trainer = self._start()

    def _start(self):
        server = build_trainer(self.trainer_settings)
        server.start()
        return server

    def restart(self, down_s: float = 0.5) -> None:
        """SIGTERM's path: refuse waiting calls, let running ones finish, record the sessions; then a new process."""
        self.trainer.stop()
        time.sleep(down_s)
        self.trainer = self._start()

    def crash(self, down_s: float = 0.5) -> None:
        """The process dies: what its last moments answered is answered, then nothing else runs and nothing is
        recorded (the calls waiting for their turn never run; no shutdown record). Threads of this test process
        cannot be killed, so the calls running finish first, as if the crash came right after them."""
        self.trainer.spec.on_shutdown = None
        self.trainer.stop()
        time.sleep(down_s)
        self.trainer = self._start()

    def client(self) -> ServiceClient:
        return ServiceClient(base_url=f"127.0.0.1:{self.port}", api_key=self.key, rollout_url="127.0.0.1:9",
                             retry_unavailable_s=60)

    def weights_sha(self, checkpoint_id: str) -> dict[str, str]:
        with self.env.db.session() as s:
            return {f["path"]: f["sha256"] for f in s.get(Checkpoint, checkpoint_id).files}

    def close(self) -> None:
        self.trainer.stop()
        self.weightsync.stop()
        self.env.close()


@pytest.fixture
def platform(tmp_path, tiny_model_dir):
    p = Platform(tmp_path / "platform", tiny_model_dir, session_state_every_steps=2)
    yield p
    p.close()


def _batch(step: int) -> list[types.Datum]:
    tokens = [(7 * step + 3 * i) % 1000 + 3 for i in range(12 + step)]
    return [types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:]})]


def _train(tc, steps) -> list:
    """Pipelined: every call is on its way before the first answer is back."""
    futures = []
    for step in steps:
        futures.append(tc.forward_backward(_batch(step), "cross_entropy"))
        futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
    return futures


def _straight(service) -> dict[str, str]:
    tc = service.create_lora_training_client("tiny", rank=4, seed=9).result()
    for f in _train(tc, range(STEPS)):
        f.result()
    return tc.save_state().result().checkpoint_id


def test_a_graceful_restart_in_the_middle_of_pipelined_calls_is_invisible(platform):
    with platform.client() as service:
        want = platform.weights_sha(_straight(service))
        tc = service.create_lora_training_client("tiny", rank=4, seed=9).result()
        futures = _train(tc, range(STEPS))
        futures[3].result()  # the restart comes while later calls are on the wire or waiting their turn
        restart = threading.Thread(target=platform.restart)
        restart.start()
        results = [f.result(timeout=120) for f in futures]
        restart.join()
        assert [r.step for r in results[1::2]] == list(range(1, STEPS + 1))
        info = tc.get_info()
        assert (info.model_id, info.next_seq_id, info.optim_steps) == (tc.model_id, 2 * STEPS + 1, STEPS)
        got = tc.save_state().result().checkpoint_id
    assert platform.weights_sha(got) == want


def test_after_a_crash_the_client_learns_what_was_lost_and_resumes_the_same_session(platform):
    with platform.client() as service:
        want = platform.weights_sha(_straight(service))
        tc = service.create_lora_training_client("tiny", rank=4, seed=9).result()
        for f in _train(tc, range(3)):  # recorded after step 2 (every 2 steps): seq_id 4, expecting 5
            f.result()
        platform.crash()
        with pytest.raises(TrainyardError) as exc:
            tc.forward_backward(_batch(3), "cross_entropy").result(timeout=120)
        assert exc.value.code == "ABORTED" and "at seq_id 5 (optimizer step 2)" in exc.value.message
        assert "answers up to seq_id 6" in exc.value.message and "resume_training_client" in exc.value.message
        with pytest.raises(TrainyardError, match="FAILED_PRECONDITION"):  # this client refuses to go on
            tc.optim_step().result()
        resumed = service.resume_training_client(tc.model_id)
        info = resumed.get_info()
        assert (info.model_id, info.next_seq_id, info.optim_steps) == (tc.model_id, 5, 2)
        for f in _train(resumed, range(info.optim_steps, STEPS)):
            f.result()
        got = resumed.save_state().result().checkpoint_id
    assert platform.weights_sha(got) == want


def test_an_unavailable_the_trainer_answered_leaves_the_client_going_on(platform):
    with platform.client() as service:
        tc = service.create_lora_training_client("tiny", rank=4, seed=9).result()
        platform.weightsync.stop()  # SaveWeights cannot publish: the trainer answers UNAVAILABLE, seq_id used up
        with pytest.raises(TrainyardError) as exc:
            tc.save_weights_for_sampler("v1").result(timeout=120)
        assert exc.value.code == "UNAVAILABLE" and "not published" in exc.value.message
        with platform.env.db.session() as s:  # a refused publish leaves no checkpoint row behind
            assert s.query(Checkpoint).filter_by(session_id=tc.model_id).count() == 0
        assert tc.forward_backward(_batch(0), "cross_entropy").result().metrics["loss:sum"] > 0
        assert tc.get_info().next_seq_id == 3


def test_a_crash_under_pipelined_calls_ends_bitwise_after_resuming(platform):
    """Wherever the crash falls among calls on the wire, every call fails (ABORTED: lost answers seen; or
    FAILED_PRECONDITION: refused after that) or succeeded before it, and resuming from the restored step ends where an
    undisturbed run does."""
    with platform.client() as service:
        want = platform.weights_sha(_straight(service))
        tc = service.create_lora_training_client("tiny", rank=4, seed=9).result()
        futures = _train(tc, range(STEPS))
        futures[5].result()
        platform.crash()
        codes = []
        for f in futures[6:]:
            error = f.exception(timeout=120)
            codes.append("OK" if error is None else error.code)
        print("calls after the crash:", codes)
        assert set(codes) <= {"OK", "ABORTED", "FAILED_PRECONDITION"}, codes
        resumed = service.resume_training_client(tc.model_id)
        info = resumed.get_info()
        assert info.next_seq_id == 2 * info.optim_steps + 1 and info.optim_steps in (2, 4, 6)
        for f in _train(resumed, range(info.optim_steps, STEPS)):
            f.result()
        got = resumed.save_state().result().checkpoint_id
    assert platform.weights_sha(got) == want
