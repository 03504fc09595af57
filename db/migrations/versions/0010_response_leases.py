"""responses: the request a background response runs, and its lease (holder + heartbeat)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 13:40:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = "0010"
down_revision: Union[str, Sequence[str], None] = "0009"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("request_body", JSON, nullable=True))
        batch.add_column(sa.Column("lease_owner", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("runs", sa.Integer(), server_default="0", nullable=False))
        batch.create_index(
            batch.f("ix_responses_lease_expires_at"), ["lease_expires_at"], unique=False
        )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("responses") as batch:
        batch.drop_index(batch.f("ix_responses_lease_expires_at"))
        batch.drop_column("runs")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
        batch.drop_column("request_body")
