"""Small C++ CPU kernels, built on first use: paged attention that reads K/V in place.

The sources are the files under ``kernels/csrc/`` (``attention.cpp``, ``layer_ops.cpp``,
``quant_gemv.cpp``, ``amx_matmul.cpp`` and the shared ``vec.h``; ``.clang-format`` there holds
their style); this module builds and loads them. The same build holds the fused layer ops
(``layer_ops.cpp``), the multi-token attention
``torch.ops.laneserve.paged_prefill_attention`` (prefill chunks and speculative verification
rows; see its comment: 8 query tokens x their query heads share each 32-key tile of K and V,
online softmax, a row's result independent of its chunk of 2+ tokens and of its batch; 1.5x the
speed of the gather + float copy + PyTorch CPU flash attention it replaces over 64-460-token
prompts on a 2-core EPYC, 1.1x at 1,024 tokens, 2.8x on 5 verification rows) and the
quantized GEMVs of ``csrc/quant_gemv.cpp`` (``int4_gemv``, ``q8_0_gemv``) and, on a CPU with
AMX, the tile matmuls of ``csrc/amx_matmul.cpp`` (``int4_amx``, ``q8_0_amx``), and the dense bf16
GEMV of ``csrc/bf16_gemv.cpp`` (``bf16_gemv``: decode-sized calls on unquantized bf16 weights).

``torch.ops.laneserve.paged_decode_attention`` computes one query token per sequence against its
context, walking the block table and reading each block where it lies in the cache: no gather, no
padding to the longest sequence. One ``at::parallel_for`` task per (sequence, KV head) keeps the
``g = Hq / Hk`` query heads of the group together. Scores, softmax and the weighted sum of V are in
fp32 (two passes: K then V); the output is rounded once to the output dtype. float32, bfloat16 and
float16 caches; any cache strides with a contiguous head dimension. On an AVX2 CPU the passes use
8-lane vectors: each K and V row is converted once for up to 4 query rows of its KV head, 8
tokens' scores are 8 x rows independent FMA chains with one horizontal add, V accumulators stay in
registers, K rows are prefetched ahead (and the next task's K and V lines into L2 while a task
runs), and ``exp`` is Cephes' polynomial (within 2 ulp of ``std::exp``; also in SiLU-mul); the
other CPUs run the same arithmetic as scalar loops. A 16-lane AVX-512 variant was measured no
faster on a Zen 4 EPYC (905 vs 938 us per layer at batch 64) and is not kept.

The sources are compiled with ``torch.utils.cpp_extension.load`` (one object per file, so a
compiler error names the file and line) into torch's extension cache
(``~/.cache/torch_extensions`` or ``TORCH_EXTENSIONS_DIR``) the first time :func:`load` runs on a
machine (1-4 minutes on 2 cores, then loaded in milliseconds). The module name carries a hash of
everything that makes one build differ from another (:func:`build_key`: the sources, their folder,
the CPU's flags for ``-march=native``, torch's version and include paths, the compiler and its
flags, the Python ABI), so two virtual environments or torch versions never share (and rewrite)
one build folder. A finished build leaves a stamp (the hash of its ``build.ninja``); a folder whose
stamp is missing or does not match, or whose library is older than a source, is rebuilt by
:func:`load_or_build_in_background` in a background thread, never in a worker's start. Without a
C++ compiler, or with ``LANESERVE_CPU_KERNELS=0``, :func:`load` returns False and callers use the
PyTorch reference.
"""

from __future__ import annotations

import hashlib
import logging
import sysconfig
import threading
from pathlib import Path

import torch

from laneserve.contracts import env

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 900  # a build takes ~1 min on 2 busy cores; past this, use the PyTorch path
CSRC = Path(__file__).with_name("csrc")
# one build: the attention kernels, the layer ops, the quantized GEMVs, the AMX matmuls
_SOURCES = (
    "attention.cpp",
    "layer_ops.cpp",
    "quant_gemv.cpp",
    "amx_matmul.cpp",
    "kquant_gemv.cpp",
    "kquant_q8k.cpp",
    "bf16_gemv.cpp",
)
_HEADERS = ("vec.h", "kquant.h", "kquant_q8k_avx512.h", "kquant_q8k_x16.h")
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
_STAMP = "laneserve-build.stamp"  # the sha256 of build.ninja, written after a build succeeded
_lock = threading.Lock()
_background = threading.Event()  # set while a background build is pending
_state: dict[str, bool] = {}


def build_key() -> str:
    """What makes one build differ from another, as one string (hashed into the module name)."""
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cpu_flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):  # a changed source or header is a new build
        digest.update((CSRC / name).read_bytes())
    parts = [
        digest.hexdigest(),
        # torch's build files name the sources by path, so two checkouts (or a checkout and a
        # wheel install) sharing one build folder would recompile each other's build
        str(CSRC.resolve()),
        cpu_flags,
        torch.__version__,
        *include_paths(),  # a venv's own torch headers: another venv is another build
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
        get_cxx_compiler(),
        " ".join(env.get(name) or "" for name in ("CXXFLAGS", "CFLAGS", "LDFLAGS")),
        *_CFLAGS,
        *_LDFLAGS,
        str(sysconfig.get_config_var("EXT_SUFFIX")),  # the Python ABI
    ]
    return "\n".join(parts)


def _build_tag() -> str:
    return hashlib.sha256(build_key().encode()).hexdigest()[:12]


def load() -> bool:
    """Build (first time on this machine) and load the extension; True when its ops are usable.

    While a build started by :func:`load_or_build_in_background` runs, returns False at once
    (callers take the PyTorch path meanwhile) instead of waiting for it.
    Never raises: a failed build is logged once as a warning and the PyTorch path is used.
    """
    if "ok" in _state:
        return _state["ok"]
    if _background.is_set():
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _try_build()
    return _state["ok"]


def _try_build() -> bool:
    if not env.get("LANESERVE_CPU_KERNELS"):
        return False
    try:
        _build_and_load()
        return hasattr(torch.ops.laneserve, "paged_decode_attention")
    except Exception as exc:  # no compiler, failed build: the reference path still works
        logger.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", exc)
        return False


def is_built() -> bool:
    """Whether this source is compiled, for this CPU, torch, compiler and Python, by a build that
    finished (loading then takes milliseconds); False means :func:`load` would compile (about
    1-4 minutes on 2 cores): no library, no stamp of a finished build, a ``build.ninja`` rewritten
    since (by another process with other settings), or a source newer than the library."""
    build_dir = build_directory()
    library, ninja, stamp = (build_dir / f"{build_dir.name}.so", build_dir / "build.ninja",
                             build_dir / _STAMP)  # fmt: skip
    try:
        built_at = library.stat().st_mtime
        if stamp.read_text().strip() != _file_digest(ninja):
            return False
    except OSError:
        return False
    sources = [CSRC / name for name in (*_SOURCES, *_HEADERS)]
    return all(path.stat().st_mtime <= built_at for path in sources)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_or_build_in_background() -> bool:
    """Load the extension now when it is built; otherwise compile it in a background thread and
    return False, so a fresh machine serves its first tokens on the PyTorch path instead of
    waiting for the compiler (`laneserve model pull` builds it ahead, see laneserve/commands/
    model.py). The ops switch to C++ once the build is loaded."""
    if "ok" in _state or not env.get("LANESERVE_CPU_KERNELS") or is_built():
        return load()
    if not _background.is_set():
        _background.set()
        logger.info("building the C++ CPU kernels in the background (once per machine)")
        threading.Thread(target=_background_build, name="cpu-ext-build", daemon=True).start()
    return False


def _background_build() -> None:
    try:
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _try_build()
                logger.info("C++ CPU kernels %s", "loaded" if _state["ok"] else "unavailable")
    finally:
        _background.clear()


def build_directory() -> Path:
    """Where this source, for this CPU and torch version, is built (in torch's extension root)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = env.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's load
    return Path(root) / f"laneserve_cpu_{_build_tag()}"


def _build_and_load() -> None:
    """Compile (or reuse) the extension under an OS file lock and load its ops.

    torch guards a build with a lock *file* that a process killed mid-build leaves behind, and
    every later build then waits for it forever. The OS lock taken here is released when its
    holder dies, and whoever holds it is the only builder, so a torch lock file found then is
    stale and is removed.
    """
    from filelock import FileLock
    from torch.utils.cpp_extension import load as load_extension

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".lock", timeout=BUILD_TIMEOUT_S):
        (build_dir / "lock").unlink(missing_ok=True)
        load_extension(
            name=build_dir.name,
            sources=[str(CSRC / name) for name in _SOURCES],
            build_directory=str(build_dir),
            extra_cflags=list(_CFLAGS),
            extra_include_paths=[str(CSRC)],
            extra_ldflags=list(_LDFLAGS),
            is_python_module=False,
            verbose=False,
        )
        (build_dir / _STAMP).write_text(_file_digest(build_dir / "build.ninja"))
