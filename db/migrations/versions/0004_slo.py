"""worker_stats: SLO targets, attainment, chosen step budget, predicted vs measured step time

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 12:00:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: Union[str, Sequence[str], None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

# (column, type): frozen here, a revision must not change when the models do
COLUMNS = (
    ("slo_interactive_ttft_ms", sa.Float()),
    ("slo_interactive_tpot_ms", sa.Float()),
    ("slo_batch_ttft_ms", sa.Float()),
    ("slo_batch_tpot_ms", sa.Float()),
    ("slo_interactive_attainment", sa.Float()),
    ("slo_batch_attainment", sa.Float()),
    ("step_token_budget", sa.Integer()),
    ("step_batch_tokens", sa.Integer()),
    ("predicted_step_ms", sa.Float()),
    ("measured_step_ms", sa.Float()),
)


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("worker_stats") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("worker_stats") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
