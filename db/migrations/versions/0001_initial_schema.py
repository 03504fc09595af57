"""initial schema: files, jobs, requests, worker_stats

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:03:25.760652

"""

from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# Frozen copies of db.models' types: a revision must not change when the models do.
JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_job_id", "files", ["job_id"], unique=False)

    op.create_table(
        "worker_stats",
        sa.Column("id", BigIntPK, autoincrement=True, nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("lanes", sa.String(length=64), nullable=True),
        sa.Column("running", sa.Integer(), nullable=True),
        sa.Column("waiting", sa.Integer(), nullable=True),
        sa.Column("kv_usage", sa.Float(), nullable=True),
        sa.Column("prefix_hit_rate", sa.Float(), nullable=True),
        sa.Column("step_ms", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("preemptions", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_stats")),
        sa.UniqueConstraint("worker_id", "at", name="uq_worker_stats_worker_id_at"),
    )
    op.create_index("ix_worker_stats_at", "worker_stats", ["at"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="validating", nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("task", sa.String(length=32), nullable=True),
        sa.Column("completion_window", sa.String(length=16), server_default="24h", nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("request_total", sa.Integer(), server_default="0", nullable=False),
        sa.Column("request_completed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("request_failed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("errors", JSONType, nullable=True),
        sa.Column("metadata", JSONType, nullable=True),
        sa.Column("owner", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("in_progress_at", sa.Float(), nullable=True),
        sa.Column("finalizing_at", sa.Float(), nullable=True),
        sa.Column("completed_at", sa.Float(), nullable=True),
        sa.Column("failed_at", sa.Float(), nullable=True),
        sa.Column("cancelling_at", sa.Float(), nullable=True),
        sa.Column("cancelled_at", sa.Float(), nullable=True),
        sa.Column("expired_at", sa.Float(), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["error_file_id"], ["files.id"], name=op.f("fk_jobs_error_file_id_files")
        ),
        sa.ForeignKeyConstraint(
            ["input_file_id"], ["files.id"], name=op.f("fk_jobs_input_file_id_files")
        ),
        sa.ForeignKeyConstraint(
            ["output_file_id"], ["files.id"], name=op.f("fk_jobs_output_file_id_files")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"], unique=False)
    op.create_index("ix_jobs_status", "jobs", ["status"], unique=False)

    op.create_table(
        "requests",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("custom_id", sa.String(length=512), nullable=True),
        sa.Column("line_no", sa.Integer(), nullable=True),
        sa.Column("lane", sa.String(length=16), server_default="interactive", nullable=False),
        sa.Column("priority", sa.Integer(), server_default="0", nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("worker_id", sa.String(length=128), nullable=True),
        sa.Column("status", sa.String(length=24), nullable=True),
        sa.Column("finish_reason", sa.String(length=24), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("preemptions", sa.Integer(), nullable=True),
        sa.Column("prefill_chunks", sa.Integer(), nullable=True),
        sa.Column("arrival_at", sa.Float(), nullable=True),
        sa.Column("first_scheduled_at", sa.Float(), nullable=True),
        sa.Column("first_token_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("queue_ms", sa.Float(), nullable=True),
        sa.Column("prefill_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("decode_ms", sa.Float(), nullable=True),
        sa.Column("tpot_ms", sa.Float(), nullable=True),
        sa.Column("itl_p99_ms", sa.Float(), nullable=True),
        sa.Column("e2e_ms", sa.Float(), nullable=True),
        sa.Column("body", JSONType, nullable=True),
        sa.Column("response", JSONType, nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_requests_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("job_id", "custom_id", name="uq_requests_job_id_custom_id"),
    )
    op.create_index("ix_requests_arrival_at", "requests", ["arrival_at"], unique=False)
    op.create_index("ix_requests_finished_at", "requests", ["finished_at"], unique=False)
    op.create_index("ix_requests_job_id_status", "requests", ["job_id", "status"], unique=False)
    op.create_index("ix_requests_lane_arrival_at", "requests", ["lane", "arrival_at"], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_requests_lane_arrival_at", table_name="requests")
    op.drop_index("ix_requests_job_id_status", table_name="requests")
    op.drop_index("ix_requests_finished_at", table_name="requests")
    op.drop_index("ix_requests_arrival_at", table_name="requests")

    op.drop_table("requests")
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_index("ix_jobs_created_at", table_name="jobs")

    op.drop_table("jobs")
    op.drop_index("ix_worker_stats_at", table_name="worker_stats")

    op.drop_table("worker_stats")
    op.drop_index("ix_files_job_id", table_name="files")

    op.drop_table("files")
