"""retention_passes: one row per pruning pass of the jobs runner

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:10:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# Frozen copy of db.models' type: a revision must not change when the models do.
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "retention_passes",
        sa.Column("id", BigIntPK, autoincrement=True, nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("older_than_s", sa.Float(), nullable=False),
        sa.Column("files", sa.Integer(), server_default="0", nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("lines", sa.Integer(), server_default="0", nullable=False),
        sa.Column("jobs", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retention_passes")),
    )
    op.create_index("ix_retention_passes_at", "retention_passes", ["at"], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_retention_passes_at", table_name="retention_passes")
    op.drop_table("retention_passes")
