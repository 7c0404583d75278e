"""weight lineages, deltas, deployments following a lineage

A lineage's current version (newest, or an older one after a rollback) is what deployments following it serve;
deltas between full-weight versions are cached; a deployment serves a checkpoint or follows a lineage

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 14:06:06.937864
"""
from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('weight_lineages',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('lineage', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('current_version_id', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_weight_lineages_account_id_accounts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_weight_lineages')),
    sa.UniqueConstraint('account_id', 'lineage', name='uq_weight_lineages_account_lineage')
    )
    with op.batch_alter_table('weight_lineages', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_weight_lineages_account_id'), ['account_id'], unique=False)

    op.create_table('weight_deltas',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('base_version_id', sa.String(length=32), nullable=False),
    sa.Column('version_id', sa.String(length=32), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['base_version_id'], ['weight_versions.id'], name=op.f('fk_weight_deltas_base_version_id_weight_versions')),
    sa.ForeignKeyConstraint(['version_id'], ['weight_versions.id'], name=op.f('fk_weight_deltas_version_id_weight_versions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_weight_deltas')),
    sa.UniqueConstraint('base_version_id', 'version_id', name='uq_weight_deltas_pair')
    )
    with op.batch_alter_table('weight_deltas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_weight_deltas_version_id'), ['version_id'], unique=False)

    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lineage', sa.String(length=128), nullable=True))
        batch_op.alter_column('checkpoint_id',
               existing_type=sa.VARCHAR(length=32),
               nullable=True)

    # Lineages published before this revision: their newest version is the current one.
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT account_id, lineage, kind, base_model, id, created_at FROM weight_versions "
                                "ORDER BY account_id, lineage, version")).fetchall()
    latest = {(r.account_id, r.lineage): r for r in rows}
    for (account_id, lineage), r in latest.items():
        conn.execute(sa.text("INSERT INTO weight_lineages (id, account_id, lineage, kind, base_model, "
                             "current_version_id, created_at, updated_at) VALUES (:id, :a, :l, :k, :b, :v, :t, :t)"),
                     {"id": f"wl_{secrets.token_hex(8)}", "a": account_id, "l": lineage, "k": r.kind,
                      "b": r.base_model, "v": r.id, "t": r.created_at})



def downgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.alter_column('checkpoint_id',
               existing_type=sa.VARCHAR(length=32),
               nullable=False)
        batch_op.drop_column('lineage')

    with op.batch_alter_table('weight_deltas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_weight_deltas_version_id'))

    op.drop_table('weight_deltas')
    with op.batch_alter_table('weight_lineages', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_weight_lineages_account_id'))

    op.drop_table('weight_lineages')
