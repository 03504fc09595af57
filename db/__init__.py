"""SQL persistence (DESIGN.md "Storage").

- `db.models`: SQLAlchemy 2.0 models (`File`, `Job`, `Request`, `WorkerStat`).
- `db.session`: `make_engine(url=None)`, `session_factory`, `write_session`/`read_session`
  (SQLite with WAL, busy_timeout, foreign keys, BEGIN IMMEDIATE for writes; PostgreSQL alike).
- `db.migrate`: `upgrade(url)` (call at start-up; locked across processes), `downgrade`,
  `current`; Alembic scripts in `db/migrations/`.
- `db.recorder`: `RecorderServer` (the `laneserve recorder` process); it writes through
  `db.record_writes` (`write_batch`, `prune`, re-exported by `db.recorder`) the rows of
  `db.record_rows` (typed records -> rows, the only place that knows the column names).
"""
