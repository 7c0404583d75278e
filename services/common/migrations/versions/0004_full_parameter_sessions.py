"""full-parameter training sessions, sessions started from a saved state

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 10:00:00.000000

Training API sessions may train every base weight (full_parameter) and may start from a SaveState path
(from_state); rows written before this revision are LoRA sessions that started fresh.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('full_parameter', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('from_state', sa.String(length=64), nullable=False, server_default=''))
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.alter_column('full_parameter', server_default=None)
        batch_op.alter_column('from_state', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.drop_column('from_state')
        batch_op.drop_column('full_parameter')
