"""The side HTTP port that serves /metrics to Prometheus, one per process."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, disable_created_metrics, start_http_server

# The `_created` timestamp series double every counter's output and no dashboard reads them.
disable_created_metrics()


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Serve /metrics from a daemon thread and print where; `port` 0 picks a free one."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    print(f"metrics listening on http://{host}:{server.server_port}/metrics", flush=True)
    return server.server_port


def add_metrics_args(parser, engine_too: bool = False) -> None:
    """--metrics-port and --metrics-host; `engine_too` adds --engine-metrics-port (for `serve`)."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus /metrics on this HTTP port; 0 picks a free one "
                             "(default: off)")
    if engine_too:
        parser.add_argument("--engine-metrics-port", type=int, default=None, metavar="PORT",
                            help="the engine process's /metrics port (default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="host the /metrics port binds (default: 127.0.0.1)")
