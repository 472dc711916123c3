"""Keeping the decoding thread the only one with an OpenMP worker team, so its small GEMMs stay fast.

GNU OpenMP (the runtime PyTorch's Linux wheels ship) gives every thread that runs a parallel
region its own team of worker threads, kept for that thread's life. Once all teams together hold
more threads than there are cores, idle workers stop spinning and sleep, so every later parallel
region pays a wake-up. The models are loaded on the main thread (one team), then the engine
decodes on its own thread (a second team): on a small machine that made a drafting step's
products, and the step, markedly slower than on the main thread (docs/DESIGN.md section 12).
Releasing the team of a thread that hands its torch work
over to another thread (and of an engine thread that goes idle) keeps one team in the process.
"""

from __future__ import annotations

import ctypes
import os
import sys

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings
_found: list[ctypes.CDLL] = []  # remembered once found; not-found is not (torch may load it later)


def _libgomps() -> list[ctypes.CDLL]:
    """Every libgomp loaded into this process (torch's bundled copy, the system's)."""
    if _found or not sys.platform.startswith("linux"):
        return _found
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return _found
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libgomp")):
        try:
            lib = ctypes.CDLL(path)  # already loaded: this only takes a handle to it
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
        except (OSError, AttributeError):  # an older libgomp without OpenMP 5.0 pause
            continue
        _found.append(lib)
    return _found


def release_thread_pool() -> bool:
    """Frees the calling thread's OpenMP worker team (rebuilt if this thread computes again).

    Only GNU OpenMP is touched: there a pause acts on the calling thread's team alone, so other
    threads' work is unaffected. Returns False where there is nothing to call (another runtime,
    not Linux); then nothing changed.
    """
    libs = _libgomps()
    return bool(libs) and all(lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0 for lib in libs)
