"""CPython's cycle collector, tuned for long-running treadle processes (the worker and the sink).

Almost everything these processes allocate is freed by reference counting; the cycle collector's full
(generation 2) passes walk every live container (the worker's ~10,000 parsed steps, Faust's services, every
module) and find next to nothing. Measured in the weaving bench's backlog run (100,016 events, py-spy and
gc.callbacks): 20 full collections took 3.7 s of the worker's 20 s of CPU and freed 294 objects, each one a
pause of ~180 ms that every step in flight waits out. What was built at startup is moved out of the collector's
sight (gc.freeze, Instagram's recipe), so each pass is shorter.

Young collections cost too: with CPython's 700, one ran every few hundred records of an input batch and walked
the batch's records, messages and rows (alive until the batch is done) again and again, ~0.6 s of a 7 s backlog
run (0.13 s of it in full passes). A first threshold of 100,000, above what a batch of
TREADLE_PROCESS_BATCH_SIZE records allocates, lets them die by reference counting before a collection walks them:
0.13 s, and no full pass in that run. Full passes then come after 10 x 20 young ones: ~300x rarer than CPython's.
Cyclic garbage is still collected, only later: at most ~100,000 objects' worth waits for the next young pass.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def tune_collector(thresholds: tuple[int, int, int]) -> None:
    """Set the collector's thresholds (gc.set_threshold); call it first thing in the process."""
    gc.set_threshold(*thresholds)


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later collections (call it when startup is done).

    Startup objects (modules, classes, the app's services) live as long as the process, so walking them in
    every full collection is pure cost; the collection first makes sure no startup garbage is frozen with them.
    """
    gc.collect()
    gc.freeze()
    log.debug("gc: %d startup objects frozen out of later collections", gc.get_freeze_count())
