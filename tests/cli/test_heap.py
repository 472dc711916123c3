"""Commands freeze what they loaded out of the cyclic collector's passes; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

from blockspec.commands.heap import freeze_loaded


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_keeps_what_lives_and_later_cycles_are_collected():
    gc.unfreeze()
    kept = _Node()
    dead_before = weakref.ref(_Node())  # garbage already: the collection before the freeze frees it
    freeze_loaded()
    assert dead_before() is None
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: no generation holds it
    later = weakref.ref(_Node())
    assert later() is not None
    gc.collect()
    assert later() is None  # made after the freeze: collected as before
