"""evaluators: uploaded reward functions and environments, one row per version

Revision ID: 0007
Revises: 0005
Create Date: 2027-01-20 10:00:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0007'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'evaluators',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('account_id', sa.String(length=32), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('filename', sa.String(length=256), nullable=False),
        sa.Column('sha256', sa.String(length=64), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_evaluators_account_id_accounts')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluators')),
        sa.UniqueConstraint('account_id', 'name', 'version', name='uq_evaluators_account_name_version'),
    )
    with op.batch_alter_table('evaluators', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evaluators_account_id'), ['account_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('evaluators', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evaluators_account_id'))
    op.drop_table('evaluators')
