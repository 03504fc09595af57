"""`laneserve model pull|path|list`: fetch the bundled model and convert it once for fast loads
(and build the C++ CPU kernels once per machine)."""

from __future__ import annotations

import argparse
import json
import sys
import time
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
    # (the kernel build takes minutes on a first run); stdout keeps the one JSON line. Where
    # stderr is not a terminal (a log file, CI) rich draws nothing until the end, so each stage
    # also prints a plain line when it starts and when it ends.
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=12),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
    ) as progress:
        stages = _Stages(progress, plain=not console.is_terminal)

        def report(stage: str, done: int, total: int) -> None:
            detail = f"{done / 1e6:.1f} / {total / 1e6:.1f} MB" if total else ""
            stages.update(stage, done, total, detail)

        path = pull_model(args.alias, progress=report)
        stages.finish_all()
        if not args.no_convert:
            from laneserve.gpu_worker.model_loader import convert_gguf

            stages.update("convert the GGUF (once)", 0, None)
            cache = convert_gguf(path, weights=False)  # the quantized path reads the GGUF
            stages.finish_all()
        else:
            cache = None
        kernels = _build_cpu_kernels(stages)
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


class _Stages:
    """The pull's stages as rich progress rows, and (`plain`) as a line on stderr when each
    starts and ends."""

    def __init__(self, progress: Progress, plain: bool) -> None:
        self.progress, self.plain = progress, plain
        self.tasks: dict[str, tuple[int, float]] = {}  # stage -> (task id, start)
        self.open: list[str] = []

    def update(self, stage: str, done: int, total: int | None, detail: str = "") -> None:
        if stage not in self.tasks:
            self.finish_all()  # the stages run one after another
            task = self.progress.add_task(stage, total=total, detail="")
            self.tasks[stage] = (task, time.monotonic())
            self.open.append(stage)
            if self.plain:
                print(f"model pull: {stage} ...", file=sys.stderr, flush=True)
        self.progress.update(self.tasks[stage][0], completed=done, detail=detail)

    def finish_all(self, detail: str | None = None) -> None:
        """Every open stage is done (a download served from the cache sends no last update)."""
        for stage in self.open:
            task, start = self.tasks[stage]
            total = self.progress.tasks[task].total or 1
            size = f"{total / 1e6:.1f} MB" if total > 1 else ""  # a byte count's row
            extra = {"detail": size} if detail is None else {"detail": detail}
            self.progress.update(task, total=total, completed=total, **extra)
            if self.plain:
                took = time.monotonic() - start
                print(f"model pull: {stage}: done in {took:.0f} s {detail or ''}".rstrip(),
                      file=sys.stderr, flush=True)  # fmt: skip
        self.open.clear()


def _build_cpu_kernels(stages: _Stages) -> str:
    """Compile the C++ CPU kernels once per machine here, at install time, so that a worker's
    first start does not spend minutes in the compiler (kernels/cpu_ext.py): "built", or
    "unavailable" (no compiler, or LANESERVE_CPU_KERNELS=0: workers use the PyTorch path)."""
    from laneserve.kernels import cpu_ext

    stages.update("build C++ CPU kernels (once, minutes)", 0, None)
    built = cpu_ext.load()
    stages.finish_all("built" if built else "unavailable (the PyTorch path serves)")
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
