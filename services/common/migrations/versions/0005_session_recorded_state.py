"""training sessions record the state a restarted trainer restores them from

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-05 10:00:00.000000

A session row names its last recorded state (a checkpoint, whether its optimizer state counts, and the seq_id the
session expects next). Sessions open before this revision were lost with the trainer that held them (it kept them in
memory only): their state_next_seq_id is 0, which a trainer reads as "not restorable" and reports as lost.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_checkpoint_id', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('state_with_optimizer', sa.Boolean(), nullable=False, server_default=sa.true()))
        batch_op.add_column(sa.Column('state_next_seq_id', sa.BigInteger(), nullable=False, server_default='0'))
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.alter_column('state_with_optimizer', server_default=None)
        batch_op.alter_column('state_next_seq_id', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.drop_column('state_next_seq_id')
        batch_op.drop_column('state_with_optimizer')
        batch_op.drop_column('state_checkpoint_id')
