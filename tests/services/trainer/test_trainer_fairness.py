"""No account can starve another on the trainer: calls waiting for their seq_id turn end as soon as their client
leaves (cancel or deadline) without using the seq_id, one account's calls in flight are bounded
(max_concurrent_calls_per_account), and open sessions per account are bounded (max_sessions_per_account).

The gRPC tests run a real trainer server in process with few threads (8), so that the far-future seq_id attack of the
hardening report (many OptimStep calls with a seq_id that never comes, abandoned by the client) would take every one
of them for order_timeout_s (600 s) without the fixes."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from api_helpers import ADAM, ApiEnv, lora, sft_datum, wire

from services.common.auth import issue_key
from services.common.calls import Cancellation
from services.common.channels import auth_metadata
from services.common.errors import Cancelled
from services.trainer.app import TrainerSettings, build
from trainyard.v1 import trainer_pb2 as pb
from trainyard.v1 import trainer_pb2_grpc

WORKERS = 8
PER_ACCOUNT = 4


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fair")
    env = ApiEnv(root, tiny_model_dir)
    keys = {name: issue_key(env.db, account, "test")[1] for name, account in (("alice", env.alice), ("bob", env.bob))}
    server = build(TrainerSettings(data_dir=root, database_url=f"sqlite:///{root / 'trainyard.db'}", host="127.0.0.1",
                                   trainer_port=0, grpc_workers=WORKERS, max_concurrent_calls_per_account=PER_ACCOUNT,
                                   shutdown_grace_s=0, order_timeout_s=600, max_sessions_per_account=2))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, trainer_pb2_grpc.TrainerServiceStub(channel), {k: auth_metadata(v) for k, v in keys.items()}, env
    channel.close()
    server.stop()
    env.close()


def _session(stub, md) -> pb.Session:
    return stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=pb.SessionLora(rank=2)), metadata=md,
                              timeout=60)


def _served(stub, md, sess: pb.Session, seq_id: int) -> None:
    """One ForwardBackward and one OptimStep of sess, each answered within 30 s."""
    data = [wire(sft_datum([5, 17, 33, 60, 2]))]
    stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sess.id, seq_id=seq_id, data=data), metadata=md,
                         timeout=30)
    stub.OptimStep(pb.OptimStepRequest(session_id=sess.id, seq_id=seq_id + 1), metadata=md, timeout=30)


def _wait_idle(server, account_id: str) -> None:
    deadline = time.monotonic() + 10
    while server.account_calls.in_flight(account_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.account_calls.in_flight(account_id) == 0


@pytest.mark.reliability
def test_abandoned_far_future_calls_leave_other_accounts_served(trainer):
    server, stub, md, env = trainer
    bob, alice = _session(stub, md["bob"]), _session(stub, md["alice"])
    # Three times the server's threads of OptimStep calls whose seq_id never comes, then abandoned by the client.
    futures = [stub.OptimStep.future(pb.OptimStepRequest(session_id=bob.id, seq_id=10**6 + i), metadata=md["bob"])
               for i in range(3 * WORKERS)]
    time.sleep(0.5)
    finished = [f for f in futures if not f.cancel()]  # cancel() is False for a call that had ended already
    assert {f.exception().code() for f in finished} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    _served(stub, md["alice"], alice, 1)  # the server's threads are not all held by bob's abandoned waits
    _wait_idle(server, env.bob)  # which ended with their clients, not after order_timeout_s
    # bob's session did not use the abandoned seq_ids: its next call is seq_id 1
    _served(stub, md["bob"], bob, 1)
    for sess, who in ((alice, "alice"), (bob, "bob")):
        stub.CloseSession(pb.CloseSessionRequest(id=sess.id), metadata=md[who])


@pytest.mark.reliability
def test_one_accounts_waiting_calls_are_bounded_by_its_quota(trainer):
    server, stub, md, env = trainer
    bob, alice = _session(stub, md["bob"]), _session(stub, md["alice"])
    waiting = [stub.OptimStep.future(pb.OptimStepRequest(session_id=bob.id, seq_id=10**6 + i), metadata=md["bob"],
                                     timeout=120) for i in range(PER_ACCOUNT)]
    deadline = time.monotonic() + 10
    while server.account_calls.in_flight(env.bob) < PER_ACCOUNT and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as refused:
        stub.OptimStep(pb.OptimStepRequest(session_id=bob.id, seq_id=10**7), metadata=md["bob"], timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota max_concurrent_calls_per_account (4) reached" in refused.value.details()
    _served(stub, md["alice"], alice, 1)  # while bob's calls wait
    # A deadline ends a wait too: the call's thread is back at once.
    with pytest.raises(grpc.RpcError) as late:
        stub.Forward(pb.ForwardRequest(session_id=alice.id, seq_id=50), metadata=md["alice"], timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(server, env.alice)
    for f in waiting:
        f.cancel()
    _wait_idle(server, env.bob)
    for sess, who in ((alice, "alice"), (bob, "bob")):
        stub.CloseSession(pb.CloseSessionRequest(id=sess.id), metadata=md[who])


def test_open_sessions_per_account_are_bounded(trainer):
    _, stub, md, _ = trainer
    first, second = _session(stub, md["bob"]), _session(stub, md["bob"])
    with pytest.raises(grpc.RpcError) as refused:
        _session(stub, md["bob"])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota max_sessions_per_account (2) reached" in refused.value.details()
    other = _session(stub, md["alice"])  # another account's quota is its own
    stub.CloseSession(pb.CloseSessionRequest(id=first.id), metadata=md["bob"])
    third = _session(stub, md["bob"])  # a closed session frees its place
    for sess, who in ((second, "bob"), (third, "bob"), (other, "alice")):
        stub.CloseSession(pb.CloseSessionRequest(id=sess.id), metadata=md[who])


def test_a_call_whose_client_leaves_before_its_turn_uses_no_seq_id(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=2))
    data = [sft_datum([5, 17, 33, 60, 2])]
    cancel, failures = Cancellation(), []

    def early_step():
        try:
            manager.optim_step(api_env.alice, sess.id, 2, ADAM, cancel=cancel)
        except Cancelled as exc:
            failures.append(exc)

    t = threading.Thread(target=early_step)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # seq_id 2 waits for seq_id 1
    cancel.cancel()
    t.join(5)
    assert not t.is_alive() and len(failures) == 1 and "was not used" in failures[0].message
    assert sess.next_seq_id == 1 and not sess.error
    manager.forward(api_env.alice, sess.id, 1, data, "", {}, backward=True)
    assert manager.optim_step(api_env.alice, sess.id, 2, ADAM)[0] == 1  # seq_id 2 again, now in its turn

