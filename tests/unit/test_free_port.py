"""tests/helpers.py:free_port, which every e2e test's servers listen on: a port it hands out must
be no other test process's, or a frontend of one run talks to an engine of another (issue 44:
two pytest runs without -n both draw from the first block, and test_lora_api's second engine
lost its port to another run's engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import helpers
from helpers import free_port

TESTS = Path(helpers.__file__).parent


def _ports_of_another_process(count: int, span: int = 1) -> list[int]:
    """`count` ports handed out by a second test process of the same worker, meanwhile."""
    code = f"import json, helpers; print(json.dumps([helpers.free_port({span}) for _ in range({count})]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env={**os.environ, "PYTHONPATH": str(TESTS)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_a_port_is_never_handed_to_two_test_processes():
    mine = free_port()
    # Enough calls that, drawing from the same block, it would pass over our port.
    theirs = _ports_of_another_process(mine - helpers._FIRST_PORT + 2)
    assert mine not in theirs
    assert len(set(theirs)) == len(theirs)


def test_a_span_is_reserved_whole():
    first = free_port(span=2)
    theirs = _ports_of_another_process(first - helpers._FIRST_PORT + 3)
    assert not {first, first + 1} & set(theirs)
    assert free_port() not in (first, first + 1)  # nor handed out again here
