"""The rollout process: the sampling engine behind RolloutService, and the OpenAI-compatible HTTP endpoint over the
same core when openai_port is set (a background task of the gRPC server: it starts and stops with it)."""
from __future__ import annotations

from services.common import metrics
from services.common.auth import KeyAuthenticator
from services.common.blobstore import BlobStore
from services.common.db import Database
from services.common.grpcserver import Server, ServiceSpec, run_service, service_server
from services.rollout.sampling_core import SamplingCore
from services.rollout.engine import Engine
from services.rollout.openai_http import OpenAIServer
from services.rollout.pinned import PinnedWeights
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings
from services.rollout.templates import TemplateSandbox
from services.rollout.weights import WeightFollower
from trainyard.v1 import rollout_pb2, rollout_pb2_grpc as rpc


def kv_gauges(engine: Engine) -> metrics.Gauges:
    """trainyard_kv_cache_blocks{model, state=used|total} of every KV pool (named by the models sharing it), read when
    scraped."""
    def read() -> dict[str, dict]:
        values = {}
        for model_dir, (used, total) in engine.kv_usage().items():
            values[(model_dir, "used")], values[(model_dir, "total")] = used, total
        return {"trainyard_kv_cache_blocks": values}

    return metrics.Gauges({"trainyard_kv_cache_blocks": ("KV cache blocks of each KV pool (the models sharing it): "
                                                         "in use and in the pool", ["model", "state"])}, read)


def build(settings: RolloutSettings) -> Server:
    settings.ensure_dirs()
    settings.apply_torch_threads()
    db = Database(settings.database_url)
    engine = Engine(settings.engine_config())
    metrics.register("kv_cache", kv_gauges(engine))
    # Deployments that follow a weight lineage hot-load its versions from the weight-sync service.
    follower = WeightFollower(engine, settings.weightsync_url, settings.data_dir / "rollout",
                              credentials=settings.channel_credentials(), load_workers=settings.weight_load_workers)
    # Weight versions sampled by path ("trainyard://weights/<id>"), fetched over the follower's channel.
    pinned = PinnedWeights(engine, follower.stub, settings.data_dir / "rollout" / "pinned",
                           settings.max_pinned_full_versions)
    templates = TemplateSandbox(settings.chat_template_workers, settings.chat_template_cpu_s,
                                settings.chat_template_memory_mb)
    core = SamplingCore(db, BlobStore(settings.blob_dir), engine, settings.adapters_dir(), follower, pinned, templates)

    def register(server) -> None:
        rpc.add_RolloutServiceServicer_to_server(RolloutServicer(core), server)

    def shutdown() -> None:
        templates.close()
        follower.close()
        engine.close()
        db.dispose()

    def stop_rendering(stopping) -> None:
        """At SIGTERM, before the grace period: a render in flight (a user's template, up to its CPU limit) fails
        at once rather than holding the shutdown; sampling calls past their render finish in the grace period."""
        stopping.wait()
        templates.close()

    spec = ServiceSpec(name="rollout", register=register, on_shutdown=shutdown, background=[stop_rendering],
                       service_names=[rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name])
    if settings.openai_port:
        http = OpenAIServer(core, KeyAuthenticator(db).account_key, host=settings.host, port=settings.openai_port,
                            max_requests=settings.openai_max_requests, grace_s=settings.shutdown_grace_s,
                            tls=dict(cert_file=settings.tls_cert_file, key_file=settings.tls_key_file,
                                     client_ca_file=settings.tls_client_ca_file))
        spec.background.append(http.serve)
    return service_server(spec, settings, settings.rollout_port, db)


def main() -> None:
    run_service(RolloutSettings, build)


if __name__ == "__main__":
    main()
