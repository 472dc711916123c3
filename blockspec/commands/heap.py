"""What a long-running command loaded stays out of Python's cyclic garbage collector's passes."""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collects once, then moves every object alive now to the collector's permanent generation
    (`gc.freeze`), so later full collections walk only what came after.

    A command's imports and models live until it exits: some 440,000 tracked objects after loading
    SmolLM2, which made each full collection a 0.2-0.3 s pause of the decode loop, landing on
    whichever step allocated when it came due (docs/DESIGN.md section 10, "Python's collector"). Objects
    made later are collected as before; call it once, after loading and before serving."""
    gc.collect()
    gc.freeze()
