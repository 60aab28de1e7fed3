"""Keep the store master's long-lived metadata out of the garbage collector's full passes.

A master holding a million objects holds about three million records the collector tracks (each
object's `ObjectMeta`, its replica list, its `Replica`). CPython's full collection walks every one of
them, about a second with the event loop stopped (no puts, no gets, no pings answered), and it runs
each time the records that survived since the last one reach a quarter of the rest: under a steady
stream of puts, every few seconds to minutes.

Right after a full collection every tracked record is alive, so freezing them then (`gc.freeze`) leaves
the next full passes only what came since. A frozen record is still freed by its reference count when
the master drops it (the metadata's records hold no cycles); only a cycle that becomes garbage after
its parts were frozen (say, a client's stream objects once it goes) waits for the next `gc.unfreeze`,
made every `unfreeze_s`, whose next full pass walks everything again. Only a full pass slow enough to
matter (`slow_s`) freezes: a small master never does.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SLOW_FULL_PASS_S = 0.05
UNFREEZE_S = 3600.0


class MetadataFreeze:
    """Installed in the store master's process (`install`), ticked by its housekeeping (`tick`)."""

    def __init__(self, slow_s: float = SLOW_FULL_PASS_S, unfreeze_s: float = UNFREEZE_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.slow_s = slow_s
        self.unfreeze_s = unfreeze_s
        self.clock = clock
        self.freezes = 0  # full passes that froze what survived them
        self.last_pass_s = 0.0  # the last full pass's length
        self._started = 0.0
        self._frozen_since = 0.0  # the first freeze since the last unfreeze
        self._logged = 0

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        gc.unfreeze()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collector, at any allocation: no logging, no allocation worth the name
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = self.clock()
            return
        self.last_pass_s = self.clock() - self._started
        if self.last_pass_s >= self.slow_s:
            if not gc.get_freeze_count():
                self._frozen_since = self.clock()
            gc.freeze()  # everything tracked survived the pass just ended: all of it is alive
            self.freezes += 1

    def tick(self) -> None:
        """Report new freezes; unfreeze once the records have been frozen for `unfreeze_s`."""
        if self.freezes != self._logged:
            self._logged = self.freezes
            log.info("a full garbage collection took %.0f ms: froze the %d records that outlived it (%d freezes)",
                     1e3 * self.last_pass_s, gc.get_freeze_count(), self.freezes)
        if gc.get_freeze_count() and self.clock() - self._frozen_since >= self.unfreeze_s:
            log.info("unfreezing %d records: the next full collection walks them all once",
                     gc.get_freeze_count())
            gc.unfreeze()
