"""job_leases: expiring claims of jobs runners on a job's control and its line ranges

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 11:30:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: Union[str, Sequence[str], None] = "0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "job_leases",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("lines_per_part", sa.Integer(), server_default="0", nullable=False),
        sa.Column("owner", sa.String(length=255), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.Column("done", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("takeovers", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_leases_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "part", name=op.f("pk_job_leases")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("job_leases")
