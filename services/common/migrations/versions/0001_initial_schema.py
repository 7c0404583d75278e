"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:52:16.544150
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('accounts',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_accounts')),
    sa.UniqueConstraint('name', name=op.f('uq_accounts_name'))
    )
    op.create_table('models',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('scope', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('architecture', sa.String(length=64), nullable=False),
    sa.Column('num_parameters', sa.BigInteger(), nullable=False),
    sa.Column('num_layers', sa.Integer(), nullable=False),
    sa.Column('hidden_size', sa.Integer(), nullable=False),
    sa.Column('vocab_size', sa.Integer(), nullable=False),
    sa.Column('max_position_embeddings', sa.Integer(), nullable=False),
    sa.Column('torch_dtype', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_models')),
    sa.UniqueConstraint('scope', 'name', name='uq_models_scope_name')
    )
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_models_scope'), ['scope'], unique=False)

    op.create_table('api_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_api_keys_account_id_accounts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_account_id'), ['account_id'], unique=False)

    op.create_table('datasets',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('format', sa.String(length=32), nullable=False),
    sa.Column('num_rows', sa.BigInteger(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_datasets_account_id_accounts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_datasets'))
    )
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_datasets_account_id'), ['account_id'], unique=False)
        batch_op.create_index('uq_datasets_account_sha', ['account_id', 'sha256'], unique=True, postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))

    op.create_table('training_sessions',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('lora_rank', sa.Integer(), nullable=False),
    sa.Column('lora_alpha', sa.Float(), nullable=False),
    sa.Column('target_modules', sa.JSON(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_training_sessions_account_id_accounts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_training_sessions'))
    )
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_sessions_account_id'), ['account_id'], unique=False)

    op.create_table('weight_versions',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('lineage', sa.String(length=128), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('parent_id', sa.String(length=32), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('files', sa.JSON(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_weight_versions_account_id_accounts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_weight_versions')),
    sa.UniqueConstraint('account_id', 'lineage', 'version', name='uq_weight_versions_lineage_version')
    )
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_weight_versions_account_id'), ['account_id'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('display_name', sa.String(length=256), nullable=False),
    sa.Column('method', sa.String(length=16), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('model_path', sa.Text(), nullable=False),
    sa.Column('dataset_id', sa.String(length=32), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('total_steps', sa.BigInteger(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('worker_id', sa.String(length=128), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('output_checkpoint_id', sa.String(length=32), nullable=False),
    sa.Column('latest_metrics', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_jobs_account_id_accounts')),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_jobs_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_account_id'), ['account_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_dataset_id'), ['dataset_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_status'), ['status'], unique=False)

    op.create_table('checkpoints',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.Column('session_id', sa.String(length=32), nullable=True),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('model_path', sa.Text(), nullable=False),
    sa.Column('files', sa.JSON(), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('final', sa.Boolean(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_checkpoints_account_id_accounts')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_account_id'), ['account_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoints_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_checkpoints_session_id'), ['session_id'], unique=False)

    op.create_table('job_logs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('level', sa.String(length=16), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_logs_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_logs'))
    )
    with op.batch_alter_table('job_logs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_logs_job_id'), ['job_id'], unique=False)

    op.create_table('job_metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_job_metrics_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_metrics'))
    )
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.create_index('ix_job_metrics_job_step', ['job_id', 'step'], unique=False)

    op.create_table('deployments',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('account_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('checkpoint_id', sa.String(length=32), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['account_id'], ['accounts.id'], name=op.f('fk_deployments_account_id_accounts')),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_deployments_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_deployments'))
    )
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_deployments_account_id'), ['account_id'], unique=False)
        batch_op.create_index('uq_deployments_account_name', ['account_id', 'name'], unique=True, postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))



def downgrade() -> None:
    with op.batch_alter_table('deployments', schema=None) as batch_op:
        batch_op.drop_index('uq_deployments_account_name', postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))
        batch_op.drop_index(batch_op.f('ix_deployments_account_id'))

    op.drop_table('deployments')
    with op.batch_alter_table('job_metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_job_metrics_job_step')

    op.drop_table('job_metrics')
    with op.batch_alter_table('job_logs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_logs_job_id'))

    op.drop_table('job_logs')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_session_id'))
        batch_op.drop_index(batch_op.f('ix_checkpoints_job_id'))
        batch_op.drop_index(batch_op.f('ix_checkpoints_account_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_status'))
        batch_op.drop_index(batch_op.f('ix_jobs_dataset_id'))
        batch_op.drop_index(batch_op.f('ix_jobs_account_id'))

    op.drop_table('jobs')
    with op.batch_alter_table('weight_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_weight_versions_account_id'))

    op.drop_table('weight_versions')
    with op.batch_alter_table('training_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_training_sessions_account_id'))

    op.drop_table('training_sessions')
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_index('uq_datasets_account_sha', postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))
        batch_op.drop_index(batch_op.f('ix_datasets_account_id'))

    op.drop_table('datasets')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_account_id'))

    op.drop_table('api_keys')
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_models_scope'))

    op.drop_table('models')
    op.drop_table('accounts')
