"""The CPU_ATTN kernel's shared library: compiled once with the machine's C compiler, kept on disk,
loaded with ctypes (lessons 05, 06).

:func:`cpu_kernel` returns the library's ``paged_attention`` function, building it on the first call
of a process when no earlier process left it on disk. The source is ``csrc/cpu_attn.c`` beside this
module. The compiler is ``$CC`` when set, else the first of ``cc``, ``gcc`` and ``clang`` on the
``PATH``; it is asked for ``-O3 -march=native -fopenmp`` and, where it refuses a flag (Apple's clang
has no OpenMP, some compilers no ``-march=native``), the next set of :data:`FLAG_SETS`, down to plain
``-O3`` (single-threaded without OpenMP). A build takes about a second here.

The library is kept in ``$PAGED_KV_CACHE_DIR``, else ``$XDG_CACHE_HOME/paged_kv``, else
``~/.cache/paged_kv`` (a temporary folder when none can be written), under a name keyed by a hash
of everything the build depends on: the source, the compiler and its version, the flags tried, the
machine's architecture and, since ``-march=native`` builds for the CPU at hand, the CPU's model and
flags. A changed source or another CPU builds anew; an unchanged one loads in milliseconds. Builds
write a temporary file and rename it into place, so processes building at once (``pytest -n 2``)
never load half a library.

Where no compiler is found or every build fails (Windows without a compiler, a macOS without the
command line tools), :func:`cpu_kernel` returns ``None`` and :func:`unavailable_reason` says why;
the registry's default then falls back to ``GATHER``. Calls through ctypes release the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "cpu_attn.c"

#: The flags asked for, best first; each set is tried until one compiles.
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)
COMMON_FLAGS = ("-std=c11", "-shared", "-fPIC")

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
#: ``paged_attention``'s parameters, in order (see the C source for their meaning).
ARGTYPES = [
    *(_P, _P, _P, _P, _I32, _P, _P, _P),  # out, query, k_cache, v_cache, cache_kind, lut, k/v strides
    *(_P, _I64, _P, _P, _I64),  # block_table, table_stride, seq_lens, query_start_loc, num_seqs
    *(_I64, _I64, _I64, _I64),  # num_heads, num_kv_heads, head_dim, block_size
    *(_F32, _F32, _I64, _F32, _I64),  # scale, v_scale, sliding_window, softcap, num_threads
]


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and ``""``, or ``None`` and why it could not be had (once per process)."""
    compiler = find_compiler()
    if compiler is None:
        return None, (
            "no C compiler found (looked for $CC, cc, gcc and clang on the PATH): install one (gcc or "
            "clang; Xcode's command line tools on macOS) to read blocks in place at C speed"
        )
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the C compiler {compiler} cannot be run: {error}"
    source = SOURCE.read_bytes()
    depends = (compiler, version, repr((*FLAG_SETS, COMMON_FLAGS)), platform.machine(), cpu_fingerprint())
    key = hashlib.sha256(b"\0".join([source, *(text.encode() for text in depends)])).hexdigest()[:16]
    library = cache_dir() / f"cpu_attn-{key}{_suffix()}"
    if not library.exists():
        problem = _compile(compiler, library)
        if problem:
            return None, problem
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as error:
        return None, f"the compiled kernel {library} cannot be loaded: {error}"
    lib.paged_attention.argtypes = ARGTYPES
    lib.paged_attention.restype = ctypes.c_int
    return lib, ""


def cpu_kernel():
    """The compiled ``paged_attention`` (a ctypes function), or ``None`` where it cannot be built."""
    lib, _ = _built()
    return None if lib is None else lib.paged_attention


def unavailable_reason() -> str:
    """Why the CPU kernel cannot be had here (building it if need be), or ``""`` when it can."""
    return _built()[1]


def cache_clear() -> None:
    """Forget this process's library, so that the next call looks for a compiler and the file again."""
    _built.cache_clear()


def find_compiler() -> str | None:
    """``$CC`` (when set and found), else the first of ``cc``, ``gcc`` and ``clang`` on the PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module): the first candidate that can be written."""
    if os.environ.get("PAGED_KV_CACHE_DIR"):
        candidates = [Path(os.environ["PAGED_KV_CACHE_DIR"])]
    elif os.environ.get("XDG_CACHE_HOME"):
        candidates = [Path(os.environ["XDG_CACHE_HOME"]) / "paged_kv"]
    else:
        candidates = [Path.home() / ".cache" / "paged_kv"]
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    candidates.append(Path(tempfile.gettempdir()) / f"paged_kv-{user}")
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    return candidates[-1]


def cpu_fingerprint() -> str:
    """What ``-march=native`` builds for: the CPU's model name and feature flags (Linux's
    ``/proc/cpuinfo``), else the processor's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _suffix() -> str:
    return {"Darwin": ".dylib", "Windows": ".dll"}.get(platform.system(), ".so")


def _compile(compiler: str, library: Path) -> str:
    """Build ``library`` with the first flag set that compiles; ``""``, or the last failure's message."""
    problem = ""
    for flags in FLAG_SETS:
        handle, temporary = tempfile.mkstemp(suffix=library.suffix, dir=library.parent)
        os.close(handle)
        command = [compiler, *flags, *COMMON_FLAGS, str(SOURCE), "-o", temporary, "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as error:
            result, problem = None, f"{' '.join(command)} could not run: {error}"
        if result is not None and result.returncode == 0:
            os.replace(temporary, library)  # atomic: another process sees the whole file or none
            return ""
        os.unlink(temporary)
        if result is not None:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            problem = f"{' '.join(command)} failed: {' / '.join(tail)}"
    return problem
