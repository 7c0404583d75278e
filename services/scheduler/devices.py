"""ResourceService: the device inventory as an account sees it (which of its jobs holds each device, which devices
are free), its quota and its queued jobs with what each waits for (services/common/resources.py)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select

from services.common.db import Database
from services.common.resources import Inventory, account_limits, aware, devices_held
from services.common.schema import Device, Job, utcnow


@dataclass
class DeviceView:
    device: Device
    live: bool
    mine: bool  # held by one of the caller's jobs


@dataclass
class AccountResources:
    devices: list[DeviceView]
    max_devices: int
    devices_in_use: int
    max_queued_jobs: int
    queued: list[Job]


class DeviceCore:
    def __init__(self, db: Database, live_within_s: float, max_devices_per_account: int,
                 max_queued_jobs_per_account: int):
        self.db = db
        self.live_within_s = live_within_s
        self.max_devices_per_account = max_devices_per_account
        self.max_queued_jobs_per_account = max_queued_jobs_per_account

    def list(self, account_id: str) -> AccountResources:
        cutoff = utcnow() - timedelta(seconds=self.live_within_s)
        devices = [DeviceView(d, aware(d.heartbeat_at) >= cutoff, d.account_id == account_id)
                   for d in Inventory(self.db).devices()]
        with self.db.session() as s:
            limits = account_limits(s, account_id, self.max_devices_per_account, self.max_queued_jobs_per_account)
            in_use = devices_held(s, account_id)
            queued = list(s.scalars(select(Job).where(Job.account_id == account_id, Job.status == "queued")
                                    .order_by(Job.priority.desc(), Job.created_at)))
        return AccountResources(devices, limits.max_devices, in_use, limits.max_queued_jobs, queued)
