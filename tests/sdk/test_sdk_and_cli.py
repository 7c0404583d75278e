"""A Client made after a server (re)starts reaches it at once, even when an earlier Client in the same process failed
to connect to that address and is in reconnect backoff (gRPC shares connections between channels with equal
options unless each channel keeps its own pool)."""
import socket
from concurrent import futures

import grpc
import pytest

from trainyard.v1 import scheduler_pb2 as pb
from trainyard.v1 import scheduler_pb2_grpc as rpc
from trainyard.client import Client
from trainyard.errors import TrainyardError


class _Accounts(rpc.AccountServiceServicer):
    def WhoAmI(self, request, context):
        return pb.Account(id="acct_1", name="probe")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_new_client_does_not_inherit_a_failed_connection():
    target = f"127.0.0.1:{_free_port()}"
    first = Client(url=target, api_key="k", timeout_s=2)
    with pytest.raises(TrainyardError) as exc:
        first.whoami()
    assert exc.value.code == "UNAVAILABLE"
    server = grpc.server(futures.ThreadPoolExecutor(2))
    rpc.add_AccountServiceServicer_to_server(_Accounts(), server)
    server.add_insecure_port(target)
    server.start()
    try:
        second = Client(url=target, api_key="k", timeout_s=2)
        assert second.whoami().name == "probe"
        second.close()
    finally:
        first.close()
        server.stop(None)


@pytest.mark.parametrize("args, expected", [
    ([], "give exactly one of --job, --checkpoint or --lineage"),
    (["--job", "job_1", "--lineage", "sess_1"], "(got --job, --lineage)"),
])
def test_deployments_create_needs_exactly_one_source(args, expected):
    from click.testing import CliRunner

    from trainyard.cli.main import cli

    result = CliRunner().invoke(cli, ["deployments", "create", "policy", *args],
                                env={"TRAINYARD_API_KEY": "k", "TRAINYARD_URL": "127.0.0.1:1"})
    assert result.exit_code == 2 and expected in result.output, result.output
