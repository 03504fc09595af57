"""`laneserve db upgrade|downgrade|current`: manage the SQL schema (Alembic migrations)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("db", help="migrate the database schema")
    parser.add_argument(
        "--db",
        default=None,
        help="database URL (default: $LANESERVE_DB_URL, else sqlite:///$LANESERVE_HOME/laneserve.db)",
    )
    actions = parser.add_subparsers(dest="db_action", metavar="ACTION", required=True)
    up = actions.add_parser("upgrade", help="migrate up (default: to the newest revision)")
    up.add_argument("revision", nargs="?", default="head")
    down = actions.add_parser("downgrade", help="migrate down (default: to an empty database)")
    down.add_argument("revision", nargs="?", default="base")
    actions.add_parser("current", help="print the database's revision ('none' when unmigrated)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from laneserve.db import migrate
    from laneserve.db.session import DatabaseURLError

    try:
        if args.db_action == "upgrade":
            migrate.upgrade(args.db, args.revision)
        elif args.db_action == "downgrade":
            migrate.downgrade(args.db, args.revision)
        print(migrate.current(args.db) or "none")
    except (migrate.MigrationError, DatabaseURLError) as exc:
        print(f"laneserve db: {exc}", file=sys.stderr)
        return 1
    return 0
