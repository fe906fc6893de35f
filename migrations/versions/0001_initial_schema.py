"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('parent_checkpoint_id', sa.Integer(), nullable=True),
    sa.Column('parent_ref', sa.String(length=512), nullable=True),
    sa.Column('policy', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('trash',
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('owner', sa.String(length=255), nullable=False),
    sa.Column('world_layout', sa.Text(), nullable=False),
    sa.Column('logical_bytes', sa.BigInteger(), nullable=False),
    sa.Column('stored_bytes_added', sa.BigInteger(), nullable=False),
    sa.Column('parent_checkpoint_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['parent_checkpoint_id'], ['checkpoints.id'], ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'step', 'status', name='uq_checkpoints_run_step_status'),
    sqlite_autoincrement=True,
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index('ix_checkpoints_status_heartbeat', ['status', 'heartbeat_at'], unique=False)

    op.create_table('entries',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('sub_key', sa.String(length=255), nullable=False),
    sa.Column('manifest', sa.LargeBinary(), nullable=False),
    sa.Column('logical_bytes', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('checkpoint_id', 'rank', 'sub_key', name='uq_entries_ckpt_rank_key')
    )
    op.create_table('metrics',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('checkpoint_id', 'name')
    )
    op.create_table('packs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('owner_checkpoint_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['owner_checkpoint_id'], ['checkpoints.id'], ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key')
    )
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_packs_owner_checkpoint_id'), ['owner_checkpoint_id'], unique=False)

    op.create_table('tags',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'name', name='uq_tags_run_name')
    )
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tags_checkpoint_id'), ['checkpoint_id'], unique=False)

    op.create_table('chunks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('digest', sa.LargeBinary(length=16), nullable=False),
    sa.Column('pack_id', sa.Integer(), nullable=False),
    sa.Column('offset', sa.BigInteger(), nullable=False),
    sa.Column('length', sa.Integer(), nullable=False),
    sa.Column('raw_size', sa.Integer(), nullable=False),
    sa.Column('codec', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['pack_id'], ['packs.id'], ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('digest')
    )
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_chunks_pack_id'), ['pack_id'], unique=False)

    op.create_table('chunk_refs',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('chunk_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['chunk_id'], ['chunks.id'], ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('checkpoint_id', 'chunk_id')
    )
    with op.batch_alter_table('chunk_refs', schema=None) as batch_op:
        batch_op.create_index('ix_chunk_refs_chunk', ['chunk_id'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('chunk_refs', schema=None) as batch_op:
        batch_op.drop_index('ix_chunk_refs_chunk')

    op.drop_table('chunk_refs')
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_chunks_pack_id'))

    op.drop_table('chunks')
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tags_checkpoint_id'))

    op.drop_table('tags')
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_packs_owner_checkpoint_id'))

    op.drop_table('packs')
    op.drop_table('metrics')
    op.drop_table('entries')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index('ix_checkpoints_status_heartbeat')

    op.drop_table('checkpoints')
    op.drop_table('trash')
    op.drop_table('runs')

