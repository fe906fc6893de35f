"""delta chunks: a chunk's base and chain depth

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable columns without defaults: SQLite and PostgreSQL add them without rewriting rows
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('base', sa.LargeBinary(length=16), nullable=True))
        batch_op.add_column(sa.Column('chain', sa.Integer(), nullable=True))
        batch_op.create_index(
            'ix_chunks_base', ['base'], unique=False,
            sqlite_where=sa.text('base IS NOT NULL'), postgresql_where=sa.text('base IS NOT NULL'),
        )


def downgrade() -> None:
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.drop_index('ix_chunks_base')
        batch_op.drop_column('chain')
        batch_op.drop_column('base')
