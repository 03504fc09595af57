"""responses: stored Responses API answers (previous_response_id, GET/DELETE /v1/responses/{id})

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 07:20:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = "0008"
down_revision: Union[str, Sequence[str], None] = "0007"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("input_items", JSON, nullable=False),
        sa.Column("response", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("responses")
