"""The trainer service as a torchrun group (services/trainer/group.py), real processes: two torchrun agents (--nnodes 2,
one process each, c10d rendezvous on 127.0.0.1) run `python -m services.trainer`; rank 0 serves gRPC and drives
rank 1. Through the SDK, two LoRA sessions and a full-parameter one make the same calls on the group and on a
one-process trainer (the reference): unary, streamed and custom-loss forward_backward with cross_entropy and the fused
importance_sampling / ppo losses, optim_step, forward, save_weights_for_sampler. Losses, logprobs and the saved
weights agree within float32 rounding (FSDP sums in another order): relative 1e-5 (logprobs and weights: atol 1e-5
and 1e-6). On the group a unary and a streamed call of the same datums give bitwise the same answer. Then rank 1 is
killed (SIGKILL): the next call is UNAVAILABLE within seconds, torchrun (--max-restarts 1) restarts the group, and the
session comes back from its last record and continues as the reference does.

Both trainers share one Postgres database (the tests' pg_url) and a weight-sync service run in this process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from services.common import registry
from services.common.auth import create_account, issue_key
from services.common.channels import auth_metadata
from services.common.blobstore import BlobStore, StoredFile
from services.common.db import Database, migrate
from services.common.errors import InvalidArgument
from services.common.schema import Checkpoint, new_id
from models.lora import LoraConfig
from services.trainer import group as trainer_group
from services.trainer.app import TrainerSettings, build as build_trainer
from services.trainer.engine import TrainingEngine
from services.trainer.engine.parallel.dims import from_mapping
from services.weightsync.app import WeightSyncSettings, build as build_weightsync
from trainyard import ServiceClient, TrainyardError, types
from trainyard.localstack import free_port
from trainyard.v1 import trainer_pb2 as tpb, trainer_pb2_grpc

from tests.services.trainer.parallel.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[3]
RTOL, ATOL_LOGPROBS, ATOL_WEIGHTS = 1e-5, 1e-5, 1e-6
UNAVAILABLE_WITHIN_S = 10.0  # from SIGKILL of rank 1 to rank 0's UNAVAILABLE answer
RESTART_WITHIN_S = 150.0  # torchrun restarts both agents' processes and rank 0 serves again


def test_the_parallel_setting_is_checked_naming_its_knob():
    with pytest.raises(InvalidArgument) as exc:
        TrainerSettings(trainer_parallel={"dp_shard": 3}).parallel_dims(2)
    assert exc.value.violations[0].field == "trainer_parallel.dp_shard"
    with pytest.raises(InvalidArgument) as exc:
        TrainerSettings(trainer_parallel={"tp": 2}).parallel_dims(2)
    assert exc.value.violations[0].field == "trainer_parallel.tp"
    with pytest.raises(InvalidArgument) as exc:
        TrainerSettings(trainer_parallel={"pp": 2}, deterministic=True).parallel_dims(2)
    assert exc.value.violations[0].field == "trainer_parallel.pp"
    with pytest.raises(InvalidArgument) as exc:
        TrainerSettings(trainer_parallel={"pp": 2, "pipeline_schedule": "1f2b"}).parallel_dims(2)
    assert exc.value.violations[0].field == "trainer_parallel.pipeline_schedule"
    assert TrainerSettings(trainer_parallel={"pp": 2, "pipeline_schedule": "gpipe"}).parallel_dims(4).dp_shard == 2
    with pytest.raises(InvalidArgument) as exc:
        TrainerSettings(trainer_parallel={"shard": 2}).parallel_dims(2)
    assert exc.value.violations[0].field == "trainer_parallel.shard"
    assert TrainerSettings(trainer_parallel={"dp_replicate": 2}).parallel_dims(4).dp_shard == 2
    assert TrainerSettings().parallel_dims(1).world_size == 1
    # `python -m services.trainer` launches the group itself when asked for more than one process
    assert trainer_group.launch_argv(TrainerSettings()) is None
    argv = trainer_group.launch_argv(TrainerSettings(trainer_nproc=2))
    assert argv[-2:] == ["-m", "services.trainer"] and "--standalone" in argv and "2" in argv
    with pytest.raises(InvalidArgument) as exc:
        trainer_group.launch_argv(TrainerSettings(trainer_nnodes=2))
    assert exc.value.violations[0].field == "trainer_rdzv_endpoint"


MOE_LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("o_proj", "down_proj", "experts"))


def _host_counts(model_dir: str, parallel: dict) -> list[int]:
    from services.trainer.sessions import SESSION_ADAMW

    host = trainer_group.EngineHost(from_mapping(parallel, world_size=2), SESSION_ADAMW, torch.device("cpu"))
    return [host.create(f"s{i}", model_dir, lora, 0, None, True, True, False)[1]
            for i, lora in enumerate((MOE_LORA, None))]


def test_a_session_on_the_group_counts_the_whole_models_trainable_parameters(family_dirs):
    """What GetSession reports, the same as one process counts, with the experts split over ep (MoE, ep 2): a
    LoRA session and a full-parameter one."""
    from services.trainer.sessions import SESSION_ADAMW

    model_dir = str(family_dirs["qwen3_moe"])
    one = [TrainingEngine.load(model_dir, lora=lora, seed=0, optimizer=SESSION_ADAMW, device="cpu").num_trainable
           for lora in (MOE_LORA, None)]
    assert run_ranks(_host_counts, 2, model_dir, {"dp_shard": 2, "ep": 2}) == [one, one]


class Platform:
    """A Postgres database with an account and the tiny model, a blob store, a weight-sync service (in process), a
    one-process trainer (in process) and a trainer group of two torchrun agents."""

    def __init__(self, root: Path, pg_url: str, model_dir: Path):
        migrate(pg_url)
        self.root, self.db = root, Database(pg_url)
        account = create_account(self.db, f"group-{new_id('t')[-8:]}")[0].id
        self.key = issue_key(self.db, account, "test")[1]
        self.model = f"tiny-{account[-8:]}"
        with self.db.session() as s:
            registry.register_model(s, account, self.model, str(model_dir))
        self.blobs = BlobStore(root / "blobs")
        common = dict(data_dir=root, database_url=pg_url, host="127.0.0.1", grpc_workers=16, shutdown_grace_s=5)
        self.weightsync = build_weightsync(WeightSyncSettings(weightsync_port=0, **common))
        self.weightsync.start()
        trainer = dict(micro_batch_tokens=32, weightsync_url=f"127.0.0.1:{self.weightsync.port}",
                       session_state_every_steps=1)
        self.reference = build_trainer(TrainerSettings(trainer_port=0, **common, **trainer))
        self.reference.start()
        self.group_port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")},
                    "PYTHONPATH": str(ROOT), "TRAINYARD_DATA_DIR": str(root), "TRAINYARD_DATABASE_URL": pg_url,
                    "TRAINYARD_HOST": "127.0.0.1", "TRAINYARD_TRAINER_PORT": str(self.group_port),
                    "TRAINYARD_WEIGHTSYNC_URL": trainer["weightsync_url"], "TRAINYARD_TORCH_THREADS": "1",
                    "TRAINYARD_MICRO_BATCH_TOKENS": "32", "TRAINYARD_SESSION_STATE_EVERY_STEPS": "1",
                    "TRAINYARD_SHUTDOWN_GRACE_S": "5", "OMP_NUM_THREADS": "1",
                    **trainer_group.TORCHRUN_ENV}
        rdzv, rdzv_id = f"127.0.0.1:{free_port()}", new_id("rdzv")
        self.agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", rdzv_id, "--max-restarts", "1",
             "--monitor-interval", "0.5", "-m", "services.trainer"],
            env=self.env, cwd=ROOT, stdout=open(root / f"agent{i}.log", "wb"), stderr=subprocess.STDOUT)
            for i in range(2)]

    def wait_for_group(self, timeout_s: float) -> float:
        """Seconds until the group's rank 0 answers as SERVING."""
        start = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{self.group_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - start < timeout_s:
                for agent in self.agents:
                    assert agent.poll() is None, f"a torchrun agent exited: {self.logs()}"
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - start
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise AssertionError(f"the trainer group did not serve within {timeout_s}s: {self.logs()}")

    def ranks(self) -> dict[int, int]:
        """Global rank -> pid of the trainer processes the agents run now."""
        out = {}
        for agent in self.agents:
            children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
            for pid in map(int, children):
                env = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
                if "RANK" in env:
                    out[int(env["RANK"])] = pid
        return out

    def client(self, port: int) -> ServiceClient:
        return ServiceClient(base_url=f"127.0.0.1:{port}", api_key=self.key, rollout_url="127.0.0.1:9",
                             retry_unavailable_s=10)

    def saved_weights(self, checkpoint_id: str) -> dict[str, torch.Tensor]:
        with self.db.session() as s:
            files = [StoredFile.from_json(f) for f in s.get(Checkpoint, checkpoint_id).files]
        out = self.blobs.materialize(files, self.root / "saved" / checkpoint_id)
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}

    def logs(self) -> str:
        return "\n".join((self.root / f"agent{i}.log").read_text(errors="replace")[-3000:] for i in range(2))

    def close(self) -> None:
        for agent in self.agents:  # SIGTERM: rank 0 records its sessions, then stops the workers
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
        self.reference.stop()
        self.weightsync.stop()
        self.db.dispose()


@pytest.fixture(scope="module")
def platform(tmp_path_factory, pg_url, tiny_model_dir):
    p = Platform(tmp_path_factory.mktemp("group"), pg_url, tiny_model_dir)
    try:
        p.wait_for_group(RESTART_WITHIN_S)
        yield p
    finally:
        p.close()


def _datum(gen: torch.Generator, n: int, rl: bool) -> types.Datum:
    tokens = torch.randint(3, 1000, (n + 1,), generator=gen).tolist()
    inputs = {"target_tokens": tokens[1:]}
    if rl:
        inputs |= {"logprobs": (-7.0 + 0.3 * torch.randn(n, generator=gen)).tolist(),
                   "advantages": torch.randn(n, generator=gen).tolist()}
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), inputs)


def _batch(seed: int, rl: bool = False) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(seed)
    # 5 datums, uneven shares over 2 ranks; 32-token micro-batches [9 23] [14] | [31] [6]: rank 0 sums its two
    # micro-batches' gradients before FSDP adds rank 1's, where one process adds all four in turn
    return [_datum(gen, n, rl) for n in (9, 23, 14, 31, 6)]


def _custom_loss(data, logprobs):
    """A loss no built-in computes: the probability-weighted NLL, with a metric."""
    loss = sum(-(lp * lp.detach().exp()).sum() for lp in logprobs)
    return loss, {"tokens": float(sum(lp.numel() for lp in logprobs))}


def _logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def _session_calls(tc) -> dict:
    """The calls the parity test makes on a session; their results."""
    got = {"ce": tc.forward_backward(_batch(1), "cross_entropy").result(),
           "is": tc.forward_backward_stream(iter(_batch(2, rl=True)), "importance_sampling").result(),
           "ppo_unary": tc.forward_backward(_batch(3, rl=True), "ppo").result(),
           "ppo_stream": tc.forward_backward_stream(iter(_batch(3, rl=True)), "ppo").result(),
           "custom": tc.forward_backward_custom(_batch(4), _custom_loss).result()}
    got["step"] = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    got["after"] = tc.forward(_batch(5), "cross_entropy").result()
    got["saved"] = tc.save_weights_for_sampler().result()
    return got


def _worst(a: list | dict, b: list | dict) -> float:
    """The largest |a - b| / max(|b|, 1e-3) over the tensors (for the measured figures)."""
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    return max(float(((x - y).abs() / y.abs().clamp_min(1e-3)).max()) for x, y in pairs)


def _assert_close_results(group: dict, ref: dict, platform: Platform) -> None:
    worst_logprobs = max(_worst(_logprobs(group[c]), _logprobs(ref[c])) for c in ("ce", "is", "custom", "after"))
    for call in ("ce", "is", "ppo_unary", "ppo_stream", "custom", "after"):
        g, r = group[call], ref[call]
        assert g.metrics.keys() == r.metrics.keys(), call
        for k in r.metrics:
            assert g.metrics[k] == pytest.approx(r.metrics[k], rel=RTOL, abs=1e-6), (call, k)
        torch.testing.assert_close(_logprobs(g), _logprobs(r), rtol=RTOL, atol=ATOL_LOGPROBS, msg=call)
    assert group["step"].step == ref["step"].step == 1
    assert group["step"].metrics["grad_norm"] == pytest.approx(ref["step"].metrics["grad_norm"], rel=RTOL)
    g, r = (platform.saved_weights(x["saved"].checkpoint_id) for x in (group, ref))
    assert g.keys() == r.keys() and g
    loss = abs(group["ce"].metrics["loss:sum"] / ref["ce"].metrics["loss:sum"] - 1)
    print(f"worst relative difference to the one-process trainer: logprobs {worst_logprobs:.2e}, saved weights "
          f"{_worst(g, r):.2e}, loss:sum {loss:.2e}")
    torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL_WEIGHTS)


def test_sessions_on_the_group_match_the_one_process_trainer(platform):
    with platform.client(platform.group_port) as group, platform.client(platform.reference.port) as ref:
        makers = {"lora_a": lambda svc: svc.create_lora_training_client(platform.model, rank=4, seed=1).result(),
                  "lora_b": lambda svc: svc.create_lora_training_client(platform.model, rank=8, seed=2).result(),
                  "full": lambda svc: svc.create_training_client(platform.model, seed=3).result()}
        clients = {name: (make(group), make(ref)) for name, make in makers.items()}
        # interleaved: the group's sessions are used one after another, each on its own sharded model
        results = {name: (_session_calls(g), _session_calls(r)) for name, (g, r) in clients.items()}
        for name, (g, r) in results.items():
            # unary and streamed calls of the same datums send the same command: bitwise the same answer
            assert g["ppo_unary"].metrics == g["ppo_stream"].metrics, name
            for a, b in zip(_logprobs(g["ppo_unary"]), _logprobs(g["ppo_stream"])):
                assert torch.equal(a, b), name
            _assert_close_results(g, r, platform)
        info = clients["lora_b"][0].get_info()
        assert info.optim_steps == 1 and info.lora_rank == 8
        # one datum on two data-parallel ranks: the rank without one runs padding only; the same answer
        (g_one, r_one) = (c.forward(_batch(6)[:1], "cross_entropy").result() for c in clients["lora_a"])
        assert len(_logprobs(g_one)) == 1
        torch.testing.assert_close(_logprobs(g_one), _logprobs(r_one), rtol=RTOL, atol=ATOL_LOGPROBS)
        assert g_one.metrics["loss:sum"] == pytest.approx(r_one.metrics["loss:sum"], rel=RTOL)
        # bad input is refused on rank 0 by name, and the session goes on
        with pytest.raises(Exception, match="data"):
            clients["lora_a"][0].forward_backward([], "cross_entropy").result()
        assert clients["lora_a"][0].forward(_batch(5), "cross_entropy").result().metrics
        clients["lora_b"][0].close()  # its engine is released on every rank; the others go on
        assert clients["full"][0].forward(_batch(5), "cross_entropy").result().metrics


def test_refusals_on_the_group_leave_the_session_going_on(platform):
    """A stream whose last datum is bad ran nothing (rank 0 checks each datum before the one command); a step whose
    gradient norm overflowed is refused by every rank's engine alike and applies nothing. Both sessions then go on
    as the one-process trainer's do."""
    overflowing = [types.Datum(d.model_input, {**d.loss_fn_inputs,
                                               "weights": [3e38] * len(d.loss_fn_inputs["target_tokens"])})
                   for d in _batch(21)]
    bad_last = [*_batch(22), types.Datum(types.ModelInput.from_ints([5, 6]), {"target_tokens": [7, 5000]})]
    outs, trainable = [], []
    with platform.client(platform.group_port) as group, platform.client(platform.reference.port) as ref:
        for svc in (group, ref):
            tc = svc.create_lora_training_client(platform.model, rank=4, seed=5).result()
            tc.forward_backward(_batch(20), "cross_entropy").result()
            with pytest.raises(TrainyardError) as exc:
                tc.forward_backward_stream(iter(bad_last), "cross_entropy").result()
            assert exc.value.code == "INVALID_ARGUMENT" and "data[5]" in exc.value.message, exc.value.message
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            tc.forward_backward(overflowing, "cross_entropy").result()
            with pytest.raises(TrainyardError) as exc:
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert exc.value.code == "INVALID_ARGUMENT" and "gradient norm" in exc.value.message, exc.value.message
            tc.forward_backward(_batch(23), "cross_entropy").result()
            assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().step == 2
            outs.append(tc.forward(_batch(24), "cross_entropy").result())
            trainable.append(tc.get_info().num_trainable_parameters)
    assert trainable[0] == trainable[1] > 0
    torch.testing.assert_close(_logprobs(outs[0]), _logprobs(outs[1]), rtol=RTOL, atol=ATOL_LOGPROBS)


def test_states_saved_on_the_group_and_on_one_process_load_on_either(platform):
    """SaveState on the group writes the sharded checkpoint (state/dcp/), on one process the single-process one;
    a session created from either (with its optimizer) on the other trainer, and LoadState on the group, go on
    as the session that saved it does."""
    def train(tc, seed):
        tc.forward_backward(_batch(seed), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    with platform.client(platform.group_port) as group, platform.client(platform.reference.port) as ref:
        for make in (lambda svc: svc.create_lora_training_client(platform.model, rank=4, seed=8).result(),
                     lambda svc: svc.create_training_client(platform.model, seed=8).result()):
            g, r = make(group), make(ref)
            for tc in (g, r):
                train(tc, 30)
            saved_g, saved_r = g.save_state().result().path, r.save_state().result().path
            from_r = group.create_training_client_from_state_with_optimizer(saved_r).result()
            from_g = ref.create_training_client_from_state_with_optimizer(saved_g).result()
            train(g, 99)  # then back to the saved state
            g.load_state_with_optimizer(saved_g).result()
            outs = []
            for tc in (g, r, from_r, from_g):
                train(tc, 31)
                outs.append(_logprobs(tc.forward(_batch(32), "cross_entropy").result()))
            for other in outs[1:]:
                torch.testing.assert_close(other, outs[0], rtol=RTOL, atol=ATOL_LOGPROBS)


def test_a_killed_rank_fails_the_next_call_quickly_and_the_group_comes_back(platform):
    with platform.client(platform.group_port) as group, platform.client(platform.reference.port) as ref:
        g, r = (svc.create_lora_training_client(platform.model, rank=4, seed=7).result() for svc in (group, ref))
        for tc in (g, r):  # recorded after the step (session_state_every_steps=1): expecting seq_id 3
            tc.forward_backward(_batch(11), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert g.get_info().next_seq_id == 3
        ranks = platform.ranks()
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        start = time.monotonic()
        stub = trainer_pb2_grpc.TrainerServiceStub(grpc.insecure_channel(f"127.0.0.1:{platform.group_port}"))
        request = tpb.ForwardRequest(session_id=g.model_id, seq_id=3, loss_fn="cross_entropy",
                                     data=[d.to_proto() for d in _batch(12)])
        with pytest.raises(grpc.RpcError) as exc:
            stub.Forward(request, metadata=auth_metadata(platform.key), timeout=60)
        took = time.monotonic() - start
        print(f"UNAVAILABLE {took:.2f}s after rank 1 was killed")
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
        assert took < UNAVAILABLE_WITHIN_S
        time.sleep(1.0)  # the old rank 0 is on its way out; then the restarted group serves
        back = platform.wait_for_group(RESTART_WITHIN_S)
        print(f"the group served again {time.monotonic() - start:.1f}s after the kill ({back:.1f}s of waiting)")
        assert set(platform.ranks()) == {0, 1} and platform.ranks()[1] != ranks[1]
        resumed = group.resume_training_client(g.model_id)
        info = resumed.get_info()
        assert (info.next_seq_id, info.optim_steps) == (3, 1)
        outs = []
        for tc in (resumed, r):
            tc.forward_backward(_batch(13), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            outs.append(tc.forward(_batch(14), "cross_entropy").result())
        torch.testing.assert_close(_logprobs(outs[0]), _logprobs(outs[1]), rtol=RTOL, atol=ATOL_LOGPROBS)
        assert outs[0].metrics["loss:sum"] == pytest.approx(outs[1].metrics["loss:sum"], rel=RTOL)
