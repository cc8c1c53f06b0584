"""Building our C++ kernels for this machine: the CPU's instruction sets, and one shared library per
source and set of compiler flags, compiled on first use into the cache directory."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from specdecode.models.cache import atomic_file, cache_root


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not to be had)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[-1].split())


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def compiler() -> str | None:
    """The C++ compiler (`CXX`, else g++), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def shared_library(name: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> Path | None:
    """`sources` compiled with `flags` into one cached shared library (keyed by the sources, the
    headers beside them, the flags, the compiler and the CPU), or None where no compiler is here
    or it fails."""
    cxx = compiler()
    if cxx is None:
        return None
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})
    text = b"".join(path.read_bytes() for path in (*sources, *headers))
    key = hashlib.sha256(
        text + " ".join(flags).encode() + cxx.encode() + " ".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{name}-{key}.so"
    if out.is_file():
        return out
    try:
        with atomic_file(out) as tmp:
            cmd = [cxx, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", *map(str, sources), "-o", str(tmp)]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                raise RuntimeError(f"{cxx} could not build {name}")  # nothing is published
    except (OSError, RuntimeError):
        return None
    return out


def load(name: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """`shared_library`, loaded; None where it cannot be built or loaded here."""
    path = shared_library(name, sources, flags)
    if path is None:
        return None
    try:  # torch is imported already, so the kernels' libgomp.so.1 is torch's: one thread pool
        return ctypes.CDLL(str(path))
    except OSError:
        return None


# ---- instruction sets --------------------------------------------------------------------------

ENV_ISA = "SPECDECODE_CPU_ISA"
ISAS = ("avx512", "avx2", "generic")  # best first
_NEEDS = {  # the CPU flags each build's compiler flags assume
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}


def isa_runs_here(isa: str) -> bool:
    """Whether this CPU can run the `isa` build (the portable one runs anywhere)."""
    return isa == "generic" or (is_x86() and _NEEDS[isa] <= cpu_flags())


def forced_isa() -> str | None:
    """The instruction set SPECDECODE_CPU_ISA forces (None: the best this CPU has; "off": no
    kernels of ours). A value that is not a set, or a set this CPU lacks, is an error."""
    from specdecode.errors import SpecDecodeError

    value = os.environ.get(ENV_ISA, "").strip().lower()
    if not value:
        return None
    if value != "off" and value not in ISAS:
        raise SpecDecodeError(f"{ENV_ISA} must be one of {', '.join((*ISAS, 'off'))}, not {value!r}")
    if value != "off" and not isa_runs_here(value):
        missing = " ".join(sorted(_NEEDS[value] - cpu_flags())) or "an x86-64 CPU"
        raise SpecDecodeError(f"{ENV_ISA}={value}: this CPU cannot run it (it lacks {missing})")
    return value


def best_isa() -> str | None:
    """The instruction set our kernels run on here: the forced one, else the best the CPU has;
    None when forced off."""
    forced = forced_isa()
    if forced == "off":
        return None
    return forced or next(isa for isa in ISAS if isa_runs_here(isa))
