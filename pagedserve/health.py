"""`pagedserve health` and `pagedserve ping-engine`: probes for container healthchecks.

    health       frontend's grpc.health.v1 Check  ─ "" (process up) or pagedserve.v1.Generation
                                                    (SERVING only while an engine is connected);
                 with --http URL, a GET of the HTTP API's /health instead (200 = ready)
    ping-engine  one Ping on the engine's ZeroMQ socket; its I/O thread answers Pong even mid-step

Both exit 0 when healthy and 1 otherwise, printing the status or the error.
"""

from __future__ import annotations

import argparse
import sys
import time

from common.process_args import positive_float

DEFAULT_GRPC_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 5.0
PING_SEQ = 1


def add_health_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_GRPC_ADDRESS,
                   help=f"the frontend's gRPC HOST:PORT (default: {DEFAULT_GRPC_ADDRESS})")
    p.add_argument("--service", default="",
                   help='service to check: "" is SERVING while the process is up (liveness); '
                        "pagedserve.v1.Generation only while an engine is connected (readiness) "
                        '(default: "")')
    p.add_argument("--http", default=None, metavar="URL",
                   help="check the HTTP API instead: GET URL (e.g. http://127.0.0.1:8000/health) must "
                        "answer 200, which it does while an engine is connected and the server is not draining")
    p.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline of the Check call, in seconds (default: {DEFAULT_TIMEOUT_S})")


def add_ping_arguments(p: argparse.ArgumentParser) -> None:
    from common.process_args import DEFAULT_ADDRESS
    p.add_argument("--address", default=DEFAULT_ADDRESS,
                   help=f"the engine's ZeroMQ endpoint, tcp://HOST:PORT or ipc://PATH (default: {DEFAULT_ADDRESS})")
    p.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S,
                   help=f"how long to wait for the Pong, in seconds (default: {DEFAULT_TIMEOUT_S})")


def check_health(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """(serving, what to print): the status name, or the RPC error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
        except grpc.RpcError as e:  # no server, unknown service (NOT_FOUND), deadline
            return False, f"{e.code().name}: {e.details()}"
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def ping_engine(address: str, timeout_s: float):
    """The engine's Pong, or None if none came within `timeout_s`. Raises zmq.ZMQError on a
    malformed address."""
    import zmq
    from google.protobuf.message import DecodeError

    from common.v1 import engine_ipc_pb2 as ipc
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        # connect() makes the pipe at once, so this queues until the TCP link is up.
        sock.send(ipc.EngineRequest(ping=ipc.Ping(seq=PING_SEQ)).SerializeToString(), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0 and sock.poll(max(1, int(left_s * 1000))):
            try:
                reply = ipc.EngineResponse.FromString(sock.recv())
            except DecodeError:
                continue
            if reply.WhichOneof("kind") == "pong" and reply.pong.seq == PING_SEQ:
                return reply.pong
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


def check_http_health(url: str, timeout_s: float) -> tuple[bool, str]:
    """(ready, what to print): the HTTP status, or why there was none."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}: {e.read(500).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(getattr(e, "reason", e))


def run_health(args: argparse.Namespace) -> int:
    if args.http is not None:
        serving, status = check_http_health(args.http, args.timeout_s)
        print(f"{args.http}: {status}", file=sys.stdout if serving else sys.stderr)
        return 0 if serving else 1
    serving, status = check_health(args.address, args.service, args.timeout_s)
    print(f"{args.address} service {args.service!r}: {status}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


def run_ping(args: argparse.Namespace) -> int:
    import zmq
    start = time.monotonic()
    try:
        pong = ping_engine(args.address, args.timeout_s)
    except zmq.ZMQError as e:
        print(f"{args.address}: {e}", file=sys.stderr)
        return 1
    if pong is None:
        print(f"{args.address}: no Pong within {args.timeout_s:g}s", file=sys.stderr)
        return 1
    s = pong.stats
    print(f"{args.address}: engine {pong.engine_id} answered in {(time.monotonic() - start) * 1000:.0f} ms "
          f"(running {s.num_running}, waiting {s.num_waiting}, "
          f"KV blocks free {s.kv_blocks_free}/{s.kv_blocks_total}, frontends {len(pong.frontends)})")
    return 0
