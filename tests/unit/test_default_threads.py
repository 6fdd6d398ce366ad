"""The CPU thread count a process takes when --num-threads is not given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.process_args import default_num_threads


@pytest.mark.parametrize("value", ["", "0", "many", "-2"])
def test_without_a_usable_omp_num_threads_it_is_the_cpus_this_process_may_use(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_num_threads() == len(os.sched_getaffinity(0))


def test_omp_num_threads_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3


def test_a_cpuset_narrower_than_the_machine_is_honoured():
    """What a container's cpuset or `taskset` gives: one CPU of the machine's several."""
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); os.environ.pop('OMP_NUM_THREADS', None); "
            "from common.process_args import default_num_threads as d; print(d())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "1", done.stderr
