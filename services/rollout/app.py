"""The rollout process: the sampling engine behind RolloutService."""
from __future__ import annotations

from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.rollout.core import RolloutCore
from services.rollout.engine import Engine
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings
from trainyard.v1 import rollout_pb2, rollout_pb2_grpc as rpc


def build(settings: RolloutSettings) -> Server:
    settings.ensure_dirs()
    settings.apply_torch_threads()
    db = Database(settings.database_url)
    engine = Engine(settings.engine_config())
    core = RolloutCore(db, BlobStore(settings.blob_dir), engine, settings.adapters_dir())

    def register(server) -> None:
        rpc.add_RolloutServiceServicer_to_server(RolloutServicer(core), server)

    def shutdown() -> None:
        engine.close()
        db.dispose()

    spec = ServiceSpec(name="rollout", register=register, on_shutdown=shutdown,
                       service_names=[rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
    return service_server(spec, settings, settings.rollout_port, db)


def main() -> None:
    run_service(RolloutSettings, build)


if __name__ == "__main__":
    main()
