"""device inventory, job resource requests and priorities, per-account quotas, job-scoped API keys

Revision ID: 0009
Revises: 0007
Create Date: 2027-01-12 10:00:00.000000

Workers register their machine's devices (GPUs, or CPU slots) in `devices`; a job holds the devices it was
allocated (job_id) until it ends. Jobs carry what they ask for (trainer_devices, rollout_devices), their priority and
why they still wait. `account_quotas` holds an operator's per-account limits. An API key may be scoped to one job.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0009'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'devices',
        sa.Column('id', sa.String(length=200), nullable=False),
        sa.Column('host', sa.String(length=160), nullable=False),
        sa.Column('kind', sa.String(length=8), nullable=False),
        sa.Column('index', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('memory_bytes', sa.BigInteger(), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=True),
        sa.Column('role', sa.String(length=16), nullable=False),
        sa.Column('account_id', sa.String(length=32), nullable=True),
        sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_devices')),
        sa.UniqueConstraint('host', 'kind', 'index', name='uq_devices_host_kind_index'),
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_devices_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_devices_account_id'), ['account_id'], unique=False)
    op.create_table(
        'account_quotas',
        sa.Column('account_id', sa.String(length=32), nullable=False),
        sa.Column('max_devices', sa.Integer(), nullable=True),
        sa.Column('max_queued_jobs', sa.Integer(), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['account_id'], ['accounts.id'],
                                name=op.f('fk_account_quotas_account_id_accounts')),
        sa.PrimaryKeyConstraint('account_id', name=op.f('pk_account_quotas')),
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('trainer_devices', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('rollout_devices', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('priority', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('wait_reason', sa.Text(), nullable=False, server_default=''))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for column in ('trainer_devices', 'rollout_devices', 'priority', 'wait_reason'):
            batch_op.alter_column(column, server_default=None)
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_id', sa.String(length=32), nullable=True))
        batch_op.create_index(batch_op.f('ix_api_keys_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_job_id'))
        batch_op.drop_column('job_id')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for column in ('wait_reason', 'priority', 'rollout_devices', 'trainer_devices'):
            batch_op.drop_column(column)
    op.drop_table('account_quotas')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_account_id'))
        batch_op.drop_index(batch_op.f('ix_devices_job_id'))
        batch_op.drop_index(batch_op.f('ix_devices_host'))
    op.drop_table('devices')
