"""End to end over gRPC: real engine and frontend processes on loopback, driven through the
generated stubs, split by concern into this package's modules. They use the worker's shared
engine and frontend (tests/e2e/conftest.py: Servers); every test that generates ends by
checking over GetServerInfo that every KV block is free again and nothing runs. Tests that
kill or stop processes start their own (the `procs` helpers)."""
