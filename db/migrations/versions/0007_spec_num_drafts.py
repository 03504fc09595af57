"""requests: speculative decoding's verifications with drafts (spec_num_drafts)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 20:10:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: Union[str, Sequence[str], None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("spec_num_drafts", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("spec_num_drafts")
