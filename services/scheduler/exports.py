"""ExportMergedModel: a LoRA checkpoint merged into its base model, streamed as a Hugging Face model directory.

Merging needs torch and the model code, which the scheduler's process never loads, so each export runs
`python -m services.trainer.export_merged` (services/trainer/export_merged.py) in a child process, as PlanJob's
planner does. The adapter's files are copied out of the object store verified against the checkpoint's manifest
before the child starts; the merged directory lives in a temporary directory under the data directory that is
removed when the stream ends (finished, failed or cancelled). A merge holds the whole model in host memory, so at
most max_merged_exports run at once and more are refused with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from services.common.blobstore import CHUNK, BlobStore
from services.common.errors import FailedPrecondition, ResourceExhausted, TrainyardError
from services.scheduler.accounts import AccountCore
from services.scheduler.checkpoints import CheckpointCore


class ExportFailed(TrainyardError):
    """The merge process failed on inputs that were checked: an INTERNAL error, with its message."""


class ExportCore:
    def __init__(self, accounts: AccountCore, checkpoints: CheckpointCore, blobs: BlobStore, work_dir: Path,
                 max_running: int = 1, command: list[str] | None = None):
        self.accounts = accounts
        self.checkpoints = checkpoints  # the account's own checkpoints and published ones, never expired
        self.blobs = blobs
        self.work_dir = Path(work_dir)
        self.command = command or [sys.executable, "-m", "services.trainer.export_merged"]
        self._slots = threading.BoundedSemaphore(max_running)
        self.max_running = max_running

    def merged_chunks(self, account_id: str, checkpoint_id: str) -> Iterator[tuple[str, int, bytes, int]]:
        """(path, offset, bytes, file size) of every file of the merged model directory, files in name order."""
        ckpt = self.checkpoints.get(account_id, checkpoint_id)
        if ckpt.kind != "lora_adapter":
            raise FailedPrecondition(f"checkpoint {ckpt.id} is a whole model already (full-parameter training): "
                                     "download it with DownloadCheckpoint")
        base_dir = ckpt.model_path or self.accounts.get_model(account_id, ckpt.base_model).path
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"{self.max_running} merged export(s) are running already (each holds a whole "
                                    "model in memory); try again when one has finished")
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=f"export-{ckpt.id}-", dir=self.work_dir) as tmp:
                adapter, out = Path(tmp) / "adapter", Path(tmp) / "merged"
                self._copy_adapter(ckpt, adapter)
                self._merge(Path(base_dir), adapter, out)
                for f in sorted(out.iterdir()):
                    size, offset = f.stat().st_size, 0
                    with open(f, "rb") as src:
                        while data := src.read(CHUNK):
                            yield f.name, offset, data, size
                            offset += len(data)
                    if size == 0:
                        yield f.name, 0, b"", 0
        finally:
            self._slots.release()

    def _copy_adapter(self, ckpt, dest: Path) -> None:
        dest.mkdir()
        for f in ckpt.files:
            target = dest / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                # DataLoss after the last chunk of damaged bytes, before anything is merged or sent.
                for data in self.blobs.read_verified(f["sha256"], f"checkpoint {ckpt.id} file {f['path']}",
                                                     size=f["size_bytes"], chunk_size=CHUNK):
                    out.write(data)

    def _merge(self, base_dir: Path, adapter: Path, out: Path) -> None:
        done = subprocess.run([*self.command, str(base_dir), str(adapter), str(out)], capture_output=True,
                              text=True)
        if done.returncode == 2:  # the inputs do not fit together: the child's one line says how
            raise FailedPrecondition(f"cannot merge the checkpoint into its base model: {done.stderr.strip()}")
        if done.returncode != 0:
            sys.stderr.write(done.stderr)  # the traceback goes to the scheduler's log, not to the client
            raise ExportFailed(f"the merge process exited with status {done.returncode}; see the scheduler's log")
