"""The four gRPC services of the platform built in this process (their real build functions and settings) over one
database (SQLite under the data directory unless a URL is given) and data directory, with accounts alice and bob;
the tiny model shared as "tiny" when given."""
from __future__ import annotations

from pathlib import Path

import grpc
from sqlalchemy import MetaData, select

from services.common import channels
from services.common.auth import create_account, issue_key
from services.common.db import Database, migrate
from services.rollout.app import build as build_rollout
from services.rollout.settings import RolloutSettings
from services.scheduler.app import build as build_scheduler
from services.scheduler.settings import SchedulerSettings
from services.trainer.app import TrainerSettings, build as build_trainer
from services.weightsync.app import WeightSyncSettings, build as build_weightsync

SERVICES = ("scheduler", "trainer", "rollout", "weightsync")


class Platform:
    def __init__(self, root: Path, model_dir: Path | None = None, database_url: str = "", **settings):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        url = database_url or f"sqlite:///{root / 'trainyard.db'}"
        migrate(url)
        self.db = Database(url)
        self.accounts, self.keys = {}, {}
        for name in ("alice", "bob"):
            account, _, self.keys[name] = create_account(self.db, name)
            self.accounts[name] = account.id
        common = dict(data_dir=root, database_url=url, host="127.0.0.1", grpc_workers=8, shutdown_grace_s=0,
                      **settings)
        self.settings = WeightSyncSettings(weightsync_port=0, **common)
        self.servers = {"weightsync": build_weightsync(self.settings)}
        self.servers["weightsync"].start()
        links = dict(weightsync_url=self.url("weightsync"))
        self.servers["rollout"] = build_rollout(RolloutSettings(rollout_port=0, **links, **common))
        self.servers["rollout"].start()
        links["rollout_url"] = self.url("rollout")
        self.servers["trainer"] = build_trainer(TrainerSettings(trainer_port=0, **links, **common))
        self.servers["trainer"].start()
        self.servers["scheduler"] = build_scheduler(SchedulerSettings(
            scheduler_port=0, builtin_tiny_models=False, shared_models={"tiny": str(model_dir)} if model_dir else {},
            watch_poll_s=0.1, **links, **common))
        self.servers["scheduler"].start()
        self._channels: list[grpc.Channel] = []

    def url(self, service: str) -> str:
        return f"127.0.0.1:{self.servers[service].port}"

    def channel(self, service: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        ch = channels.open_channel(self.url(service), credentials=credentials)
        self._channels.append(ch)
        return ch

    def metadata(self, who: str = "alice") -> tuple:
        return channels.auth_metadata(self.keys[who])

    def new_key(self, who: str = "alice") -> tuple[str, str]:
        """(key id, secret) of another key of the account."""
        key, secret = issue_key(self.db, self.accounts[who], "extra")
        return key.id, secret

    def rows(self) -> dict[str, list]:
        """Every row of every table, to show that a call changed nothing."""
        meta = MetaData()
        meta.reflect(self.db.engine)
        with self.db.engine.connect() as conn:
            return {name: sorted(map(tuple, conn.execute(select(table)).all()), key=repr)
                    for name, table in meta.tables.items()}

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        for name in reversed(SERVICES):
            self.servers[name].stop()
        self.db.dispose()
