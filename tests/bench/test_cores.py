"""kiln_bench.cores: the timed steps' threads pinned to the chosen cores, every thread back on all cores after."""
import os
import threading

import pytest

from kiln_bench import cores


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores")
def test_pinned_moves_every_thread_and_restores_them():
    allowed = os.sched_getaffinity(0)
    one = min(allowed)
    seen, go, done = {}, threading.Event(), threading.Event()

    def worker():   # a thread started before the pin (as autograd's device thread is)
        go.wait()
        seen["inside"] = os.sched_getaffinity(0)
        done.set()
    t = threading.Thread(target=worker)
    t.start()
    with cores.pinned((one,)):
        assert os.sched_getaffinity(0) == {one}
        go.set()
        done.wait(10)
    t.join()
    assert seen["inside"] == {one}
    assert os.sched_getaffinity(0) == allowed


def test_nothing_to_pick_without_a_gpu():
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert cores.fast_cores("cpu") == {} and cores.pin_process("cpu") == {}
    assert allowed is None or os.sched_getaffinity(0) == allowed   # nothing pinned
    with cores.pinned(()):   # no cores: no change
        pass
