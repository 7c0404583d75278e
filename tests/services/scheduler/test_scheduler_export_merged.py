"""ExportMergedModel through the real scheduler (in process, SQLite) and the SDK: a LoRA checkpoint of the tiny model
merged into its base by the export child process, streamed back as a Hugging Face model directory.

References: every merged weight against W + B @ A * alpha / r computed here from the adapter's own file (1e-6), and the
directory loaded by transformers against peft's merge_and_unload of the same adapter (logits within 1e-5)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.lora import apply_lora, save_peft_adapter
from models.lora_layers import LoraConfig
from models import load_pretrained
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.schema import Checkpoint, new_id, utcnow
from services.scheduler.app import build
from services.scheduler.settings import SchedulerSettings
from trainyard import Client, TrainyardError

pytestmark = pytest.mark.usefixtures("one_thread")
PEFT_PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir):
    """A rank-4 adapter on q_proj/v_proj with B drawn at random (a trained-looking adapter: B is not zero)."""
    model = load_pretrained(tiny_model_dir)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    params = apply_lora(model, cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(model, cfg, out, "tiny-qwen3")
    return out


@pytest.fixture()
def scheduler(tmp_path, tiny_model_dir, adapter_dir):
    settings = SchedulerSettings(data_dir=tmp_path / "data", host="127.0.0.1", scheduler_port=0, grpc_workers=4,
                                 shutdown_grace_s=0, builtin_tiny_models=False)
    migrate(settings.database_url)
    db = Database(settings.database_url)
    alice, _, key = create_account(db, "alice")
    _, _, other_key = create_account(db, "mallory")
    blobs = BlobStore(settings.blob_dir)
    files = [f.to_json() for f in blobs.put_tree(adapter_dir)]
    lora = Checkpoint(id=new_id("ckpt"), account_id=alice.id, base_model="tiny-qwen3", model_path=str(tiny_model_dir),
                      created_at=utcnow(), files=files, final=True)
    full = Checkpoint(id=new_id("ckpt"), account_id=alice.id, base_model="tiny-qwen3", kind="full",
                      created_at=utcnow(), files=files)
    with db.session() as s:
        s.add_all([lora, full])
    server = build(settings)
    server.start()
    try:
        yield f"127.0.0.1:{server.port}", key, other_key, lora, full, blobs
    finally:
        server.stop()
        db.dispose()


def test_merged_weights_are_base_plus_scaled_update_and_load_in_transformers(scheduler, tmp_path, tiny_model_dir,
                                                                              adapter_dir):
    url, key, _, lora, _, _ = scheduler
    with Client(url=url, api_key=key) as client:
        out = client.export_merged_model(lora.id, tmp_path / "merged")
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "model.safetensors" in names and "tokenizer.json" in names

    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    assert set(merged) == set(base)
    changed = 0
    for name, w in base.items():
        stem = PEFT_PREFIX + name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" in adapter:
            a, b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
            expected = w.double() + (b.double() @ a.double()) * scale
            torch.testing.assert_close(merged[name].double(), expected, atol=1e-6, rtol=0)
            changed += 1
        else:
            assert torch.equal(merged[name], w), name
    assert changed == 2 * json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]

    from click.testing import CliRunner

    from trainyard.cli.main import cli

    result = CliRunner().invoke(cli, ["checkpoints", "download", lora.id, str(tmp_path / "cli"), "--merged"],
                                env={"TRAINYARD_URL": url, "TRAINYARD_API_KEY": key})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                          adapter_dir).merge_and_unload().eval()
    ids = AutoTokenizer.from_pretrained(out)("2 plus 3 is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_export_refuses_full_checkpoints_other_accounts_and_damaged_adapters(scheduler, tmp_path, flip_byte):
    url, key, other_key, lora, full, blobs = scheduler
    with Client(url=url, api_key=other_key) as other, pytest.raises(TrainyardError) as err:
        other.export_merged_model(lora.id, tmp_path / "theirs")
    assert err.value.code == "NOT_FOUND" and not list((tmp_path / "theirs").iterdir())
    with Client(url=url, api_key=key) as client:
        with pytest.raises(TrainyardError) as err:
            client.export_merged_model(full.id, tmp_path / "full")
        assert err.value.code == "FAILED_PRECONDITION" and "DownloadCheckpoint" in err.value.message

        weights = next(f for f in lora.files if f["path"] == "adapter_model.safetensors")
        flip_byte(blobs.path(weights["sha256"]), -10)
        with pytest.raises(TrainyardError) as err:
            client.export_merged_model(lora.id, tmp_path / "damaged")
        assert err.value.code == "DATA_LOSS" and "adapter_model.safetensors" in err.value.message
        assert not list((tmp_path / "damaged").iterdir())
