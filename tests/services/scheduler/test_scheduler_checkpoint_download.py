"""DownloadCheckpoint through the real scheduler (in process, SQLite) and the SDK/CLI: the server verifies each file
as it streams it, and the SDK checks what it receives against the checkpoint's manifest (what was stored), so a byte
flipped at rest is DATA_LOSS naming the checkpoint and the file, with no damaged file left behind."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import DataLoss
from services.common.schema import Checkpoint, new_id, utcnow
from services.scheduler.checkpoints import CheckpointCore
from services.scheduler.app import build
from services.scheduler.settings import SchedulerSettings
from trainyard import Client, TrainyardError

pytestmark = pytest.mark.reliability

WEIGHTS = bytes(range(256)) * 9000  # 2.3 MB: three chunks of the stream


@pytest.fixture()
def scheduler(tmp_path):
    settings = SchedulerSettings(data_dir=tmp_path / "data", host="127.0.0.1", scheduler_port=0, grpc_workers=4,
                                 shutdown_grace_s=0, builtin_tiny_models=False)
    migrate(settings.database_url)
    db = Database(settings.database_url)
    account, _, key = create_account(db, "alice")
    blobs = BlobStore(settings.blob_dir)
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_config.json").write_text('{"r": 4}')
    (src / "adapter_model.safetensors").write_bytes(WEIGHTS)
    (src / "README.md").write_text("")  # an empty file travels as no chunks at all
    ckpt = Checkpoint(id=new_id("ckpt"), account_id=account.id, base_model="tiny", created_at=utcnow(),
                      files=[f.to_json() for f in blobs.put_tree(src)])
    with db.session() as s:
        s.add(ckpt)
    server = build(settings)
    server.start()
    try:
        yield server, db, blobs, key, ckpt, src
    finally:
        server.stop()
        db.dispose()


def test_download_verifies_against_the_manifest(scheduler, tmp_path, flip_byte):
    server, db, blobs, key, ckpt, src = scheduler
    weights = next(f for f in ckpt.files if f["path"] == "adapter_model.safetensors")
    with Client(url=f"127.0.0.1:{server.port}", api_key=key) as client:
        out = client.download_checkpoint(ckpt.id, tmp_path / "ok")
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]
        assert all((out / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())

        flip_byte(blobs.path(weights["sha256"]), len(WEIGHTS) - 10)
        with pytest.raises(DataLoss, match=f"checkpoint {ckpt.id} file adapter_model.safetensors: blob "
                                           f"{weights['sha256']} is damaged"):
            for _ in CheckpointCore(db, blobs).chunks(ckpt.account_id, ckpt.id):
                pass
        with pytest.raises(TrainyardError) as exc:
            client.download_checkpoint(ckpt.id, tmp_path / "bad")
        assert exc.value.code == "DATA_LOSS"
        assert f"checkpoint {ckpt.id} file adapter_model.safetensors" in exc.value.message
        assert list((tmp_path / "bad").iterdir()) == []  # nothing half-right left behind

    from trainyard.cli.main import cli

    result = CliRunner().invoke(cli, ["checkpoints", "download", ckpt.id, str(tmp_path / "cli")],
                                env={"TRAINYARD_URL": f"127.0.0.1:{server.port}", "TRAINYARD_API_KEY": key})
    assert result.exit_code == 1 and "DATA_LOSS" in result.output, result.output
    assert f"checkpoint {ckpt.id} file adapter_model.safetensors" in " ".join(result.output.split())
    assert list((tmp_path / "cli").iterdir()) == []
