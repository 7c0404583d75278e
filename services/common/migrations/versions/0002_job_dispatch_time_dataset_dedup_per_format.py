"""job dispatch time, dataset dedup per format

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:25:10.211902

Jobs record when their attempt reached the broker, so the reaper can hand over jobs a stopped scheduler never sent;
the same file uploaded as two formats (e.g. SFT chat and RFT) is two datasets.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_index('uq_datasets_account_sha')
        batch_op.create_index('uq_datasets_account_sha_format', ['account_id', 'sha256', 'format'], unique=True, postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('dispatched_at')

    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_index('uq_datasets_account_sha_format', postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))
        batch_op.create_index('uq_datasets_account_sha', ['account_id', 'sha256'], unique=True,
                              postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))

