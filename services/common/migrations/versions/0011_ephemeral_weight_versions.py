"""ephemeral weight versions: published for sampling only, deleted once newer ones replace them

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-01 10:00:00.000000

A weight version may be ephemeral (a Training API SaveWeights with ephemeral set: Tinker's
save_weights_and_get_sampling_client). The weight-sync service keeps a lineage's few newest ones; an older one is
deleted: its files are released and deleted_at set, the row staying so that asking for it names it as replaced.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ephemeral', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.alter_column('ephemeral', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')
        batch_op.drop_column('ephemeral')
