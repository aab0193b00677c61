"""tools/bench/quiet.py: a measurement waits while its cores are busy, read from the machine's real /proc/stat."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tools.bench import quiet

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat (Linux)")


@pytest.fixture
def busy_core():
    """A process spinning on one core of this process's affinity; the core's number."""
    core = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    time.sleep(0.3)  # it has started spinning
    yield core
    proc.kill()
    proc.wait()


def test_a_spinning_core_reads_busy_and_holds_the_measurement_back_until_the_timeout(busy_core):
    before = quiet._ticks([busy_core])
    time.sleep(0.5)
    assert quiet.idle_share(before, quiet._ticks([busy_core])) < 0.5
    waited = asyncio.run(quiet.until_idle([busy_core], window_s=0.1, timeout_s=0.6))
    assert waited >= 0.6


def test_a_core_that_meets_the_share_ends_the_wait_after_one_window():
    waited = asyncio.run(quiet.until_idle([min(os.sched_getaffinity(0))], share=0.0, window_s=0.1, timeout_s=30))
    assert 0.1 <= waited < 30


def test_idle_share_counts_only_the_ticks_between_two_readings():
    assert quiet.idle_share((100, 400), (190, 500)) == pytest.approx(0.9)
    assert quiet.idle_share((100, 400), (100, 400)) == 1.0
    idle, total = quiet._ticks(None)
    assert 0 < idle <= total
    assert quiet._ticks([10_000]) == (0, 0)  # a core the machine does not have counts nothing
