"""requests: the request's kind (generate | embed)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 10:20:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = "0009"
down_revision: Union[str, Sequence[str], None] = "0008"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(
            sa.Column("kind", sa.String(16), nullable=False, server_default="generate")
        )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("kind")
