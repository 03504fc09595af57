"""requests: speculative decoding figures (spec_draft_tokens, spec_accepted_tokens)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 11:40:00.000000

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("spec_draft_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("spec_accepted_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("spec_accepted_tokens")
        batch.drop_column("spec_draft_tokens")
