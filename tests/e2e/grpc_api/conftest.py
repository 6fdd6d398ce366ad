"""End to end over gRPC: real engine and frontend processes on loopback, driven through the
generated stubs, split by concern into this package's modules. They share one engine and
one frontend (package-scoped: started once for all of them); every test that generates ends
by checking over GetServerInfo that every KV block is free again and nothing runs. Tests
that kill or stop processes start their own (the `procs` helpers)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def engine_address(procs):
    address = f"tcp://127.0.0.1:{procs.free_port()}"
    engine = procs.start_engine(address)
    yield address
    procs.stop(engine)


@pytest.fixture(scope="package")
def frontend(engine_address, procs):
    fe = procs.start_frontend(engine_address)
    fe.wait_serving()
    yield fe
    fe.close()


@pytest.fixture(scope="package")
def limited_frontend(engine_address, procs):
    """A second frontend on the shared engine that admits one stream at a time."""
    fe = procs.start_frontend(engine_address, "--max-concurrent-streams", "1")
    fe.wait_serving()
    yield fe
    fe.close()
