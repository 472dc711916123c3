"""Giving freed memory back to the operating system when the engine goes idle.

glibc keeps the memory of freed allocations in its heaps for reuse; after a burst of requests
(joins of long prompts, many rows' logits) most of it stays resident although nothing uses it.
`trim_heap` returns what can be returned; a no-op where glibc's malloc_trim is not available.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_libc: list[ctypes.CDLL | None] = []


def _malloc_trim() -> object | None:
    if not _libc:
        lib = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                lib = None
        _libc.append(lib)
    return _libc[0].malloc_trim if _libc[0] is not None else None


def trim_heap() -> bool:
    """Returns freed heap memory to the OS (glibc malloc_trim(0)); False where unsupported."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
