"""checkpoints: weight version, public, user metadata, expiry; training sessions: last request time

Revision ID: 0010
Revises: 0009
Create Date: 2027-01-20 10:00:00.000000

Tinker's REST surface (docs/tinker_compat.md, RestClient): a SaveWeights checkpoint names the weight version it
published; a checkpoint may be published (readable by every account), carry the user's metadata and expire. A
session records when it last received a call.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weight_version_id', sa.String(length=32), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('public', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('user_metadata', sa.JSON(), nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f('ix_checkpoints_weight_version_id'), ['weight_version_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoints_expires_at'), ['expires_at'], unique=False)
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        for column in ('weight_version_id', 'public', 'user_metadata'):
            batch_op.alter_column(column, server_default=None)
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_request_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.drop_column('last_request_at')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_expires_at'))
        batch_op.drop_index(batch_op.f('ix_checkpoints_weight_version_id'))
        for column in ('expires_at', 'user_metadata', 'public', 'weight_version_id'):
            batch_op.drop_column(column)
