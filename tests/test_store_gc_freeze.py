"""The store master's metadata freeze (store/gc_freeze.py): what survives a slow full collection is frozen, a
frozen record is still freed when dropped, garbage made later is still collected, and the records are
unfrozen after `unfreeze_s`. Run in a process of its own: freezing the test runner's objects would change
every test after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, logging, weakref
    from mooncaked.store.gc_freeze import MetadataFreeze
    from mooncaked.store.records import ObjectMeta, Replica

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gc.collect()
    records = {f"m/{i}": ObjectMeta(f"m/{i}", 4096, i, [Replica("seg", 4096 * i, 4096, True)], True, 0.0)
               for i in range(50_000)}

    class Held:  # a record that takes a weak reference (ObjectMeta has slots and none)
        pass
    kept = {"k": Held()}

    never = MetadataFreeze(slow_s=1e9)  # no pass is that slow: nothing is frozen
    never.install()
    gc.collect()
    assert gc.get_freeze_count() == 0 and never.freezes == 0
    never.uninstall()

    freeze = MetadataFreeze(slow_s=0.0, unfreeze_s=3600.0)
    freeze.install()
    gc.collect(1)  # a younger generation's pass freezes nothing
    assert gc.get_freeze_count() == 0
    gc.collect()
    frozen = gc.get_freeze_count()
    assert freeze.freezes == 1 and frozen >= 3 * 50_000, frozen  # the record, its replica list, its replica

    # a frozen record the master drops is freed at once (reference counting), not kept by the freeze
    gone = []
    ref = weakref.ref(kept["k"], lambda _: gone.append(1))
    del kept["k"]
    assert gone == [1] and ref() is None

    # garbage made after the freeze is still collected
    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a
    cycle = weakref.ref(a)
    del a, b
    gc.collect()
    assert cycle() is None

    freeze.tick()  # reports the freeze; not yet time to unfreeze
    assert gc.get_freeze_count() > 0
    freeze.unfreeze_s = 0.0
    freeze.tick()
    assert gc.get_freeze_count() == 0
    freeze.uninstall()
    assert freeze._on_gc not in gc.callbacks
    print("ok", frozen)
""")


def test_a_slow_full_collection_freezes_the_records_that_outlived_it_and_nothing_is_kept_alive():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
    assert "froze the" in run.stderr and "unfreezing" in run.stderr, run.stderr
