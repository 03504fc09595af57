"""dashboard indexes: requests windows filtered by lane or model, read by finished_at

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 11:40:00.000000

The dashboard reads `requests` by `finished_at` window, optionally for one lane or one model,
and lists the distinct models; on a 1M-row table these indexes turn the filtered reads and the
model list into index range scans (scripts/bench_dashboard.py measures the refresh).
"""

from typing import Sequence, Union

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0005"
down_revision: Union[str, Sequence[str], None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_index(
        "ix_requests_lane_finished_at", "requests", ["lane", "finished_at"], unique=False
    )
    op.create_index(
        "ix_requests_model_finished_at", "requests", ["model", "finished_at"], unique=False
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_requests_model_finished_at", table_name="requests")
    op.drop_index("ix_requests_lane_finished_at", table_name="requests")
