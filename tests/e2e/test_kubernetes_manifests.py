"""deploy/kubernetes, checked without a cluster: each overlay rendered by kustomize (`kustomize
build`, else the one inside `kubectl kustomize`), validated by kubernetes-validate's bundled
schemas (strict: unknown fields fail) for the oldest and newest Kubernetes we claim, KEDA's
ScaledObject by a schema of our own; then the invariants that schemas cannot see (selectors,
ports, args against probes, the model's name from its ConfigMap, the Hugging Face cache and
token); then the engine started with the manifest's own args, probed as the kubelet would, and
stopped as the kubelet does."""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cli import build_parser


ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu", "keda"]
# grpc probes are GA since 1.27; 1.29 is the oldest release the big clouds still run.
KUBERNETES_VERSIONS = ["1.29.0", "1.37.0"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_POLICY = {"type": "object", "required": ["type", "value", "periodSeconds"],
           "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                          "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}
# The fields of KEDA's ScaledObject CRD (keda.sh/v1alpha1) that we use, as KEDA 2.x defines them;
# unknown fields fail, as in the strict Kubernetes schemas.
SCALED_OBJECT_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {k: {"type": "string"} for k in ("apiVersion", "kind", "name")}},
                **{k: {"type": "integer", "minimum": 0} for k in
                   ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod")},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                      "properties": {"behavior": {"type": "object"}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}},
            },
        },
    },
}
PROMETHEUS_METADATA = {"type": "object", "required": ["serverAddress", "query", "threshold"],
                       "properties": {"threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}}}


# -- rendering --------------------------------------------------------------------------

@functools.cache
def kustomize_command() -> tuple[str, ...]:
    """`kustomize build`, else `kubectl kustomize` (kubectl carries kustomize); v5, as the
    manifests use `labels` and components. Skips where neither is installed."""
    for command, version in ((("kustomize", "build"), ["kustomize", "version"]),
                             (("kubectl", "kustomize"), ["kubectl", "version", "--client"])):
        if shutil.which(command[0]):
            out = subprocess.run(version, capture_output=True, text=True, timeout=30).stdout
            found = re.search(r"(?:Kustomize Version: |^)v?(\d+)\.", out, re.MULTILINE)
            assert found and int(found.group(1)) >= 5, f"kustomize v5 needed, {' '.join(version)} says:\n{out}"
            return command
    pytest.skip("neither kustomize nor kubectl is installed (kubectl >= 1.31 carries kustomize v5)")


@functools.cache
def _render(overlay: str) -> tuple[dict, ...]:
    done = subprocess.run([*kustomize_command(), str(KUBERNETES / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"kustomize failed on overlays/{overlay}:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_render(overlay)))


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"want one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def main_container(docs: list[dict], kind: str) -> dict:
    """The workload's first container, its args as the kubelet passes them ($(VAR) expanded)."""
    container = containers(one(docs, kind), init=False)[0]
    container["args"] = kubelet_args(docs, container)
    return container


def env_values(docs: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet sets it: literal values, and ConfigMap keys
    from the rendered ConfigMaps; Secrets are not in the manifests, so their variables are unset
    (allowed only where the reference is optional)."""
    values = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            values[var["name"]] = one(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            assert source["secretKeyRef"].get("optional") is True, f"{var['name']} needs a Secret"
    return values


def kubelet_args(docs: list[dict], container: dict) -> list[str]:
    """`$(NAME)` in args replaced by the variable's value, as the kubelet does; an unset one stays."""
    env = env_values(docs, container)
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in container["args"]]


def parse_args(container: dict):
    return build_parser().parse_args(container["args"])


def flag(args: list[str], name: str) -> str:
    values = [v for f, v in zip(args, args[1:]) if f == name]
    assert values, f"{name} missing from {args}"
    return values[-1]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates(overlay):
    docs = render(overlay)
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            validate_scaled_object(doc)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {e.message} "
                                     f"at {'.'.join(map(str, e.path))}") from None


def validate_scaled_object(doc: dict) -> None:
    jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
    for trigger in doc["spec"]["triggers"]:
        if trigger["type"] == "prometheus":
            jsonschema.validate(trigger["metadata"], PROMETHEUS_METADATA)
    behavior = doc["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior:  # KEDA passes it to the HPA it makes: Kubernetes' own schema applies
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
               "spec": {"scaleTargetRef": {"kind": "StatefulSet", "name": "x"}, "maxReplicas": 1,
                        "behavior": behavior}}
        kubernetes_validate.validate(hpa, KUBERNETES_VERSIONS[-1], strict=True)


def test_validators_reject_mistakes():
    """The validation above can fail: a misspelt field, a string where a port goes."""
    statefulset = one(render("cpu"), "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)
    scaled = one(render("keda"), "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 8
    with pytest.raises(jsonschema.ValidationError):
        validate_scaled_object(scaled)
    scaled = one(render("keda"), "ScaledObject")
    scaled["spec"]["minReplicas"] = 1  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        validate_scaled_object(scaled)


# -- invariants -----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pod_labels(overlay):
    docs = render(overlay)
    pods = {(w["kind"], w["metadata"]["name"]): w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)}
    for w in workloads(docs):
        assert selects(w["spec"]["selector"]["matchLabels"], pods[(w["kind"], w["metadata"]["name"])])

    def selected(selector: dict) -> list:
        return [key for key, labels in pods.items() if selects(selector, labels)]

    engine, frontend = ("StatefulSet", "pagedserve-engine"), ("Deployment", "pagedserve-frontend")
    assert selected(one(docs, "Service", "pagedserve-engine")["spec"]["selector"]) == [engine]
    assert selected(one(docs, "Service", "pagedserve-frontend")["spec"]["selector"]) == [frontend]
    assert selected(one(docs, "PodDisruptionBudget", "pagedserve-engine")["spec"]["selector"]["matchLabels"]) == [engine]
    assert selected(one(docs, "PodDisruptionBudget", "pagedserve-frontend")["spec"]["selector"]["matchLabels"]) == [frontend]
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        assert selected(policy["spec"]["podSelector"]["matchLabels"]) == [("StatefulSet", policy["metadata"]["name"])] \
            or selected(policy["spec"]["podSelector"]["matchLabels"]) == [("Deployment", policy["metadata"]["name"])]
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert selected(peer["podSelector"]["matchLabels"]), f"{policy['metadata']['name']}: {peer}"
    target = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == frontend
    one(docs, target["kind"], target["name"])
    assert one(docs, "StatefulSet")["spec"]["serviceName"] == "pagedserve-engine"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probe_ports_exist_and_resources_are_set(overlay):
    for workload in workloads(render(overlay)):
        for c in containers(workload):
            where = f"{workload['metadata']['name']}/{c['name']}"
            for need in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(need, {})), f"{where}: {need}"
            ports = {p["containerPort"] for p in c.get("ports", [])} | {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    action = next(c[probe][k] for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in c[probe])
                    assert "port" not in action or action["port"] in ports, f"{where} {probe} port {action}"
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1)
        assert pod["securityContext"]["runAsUser"] == int(uid)  # the image's user owns its caches
        mounts = {m["mountPath"] for c in containers(workload, init=False) for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts  # the root filesystem is read-only


def test_engine_cache_is_writable_and_seeded_from_the_image():
    statefulset = one(render("cpu"), "StatefulSet")
    engine, (seed,) = containers(statefulset, init=False)[0], statefulset["spec"]["template"]["spec"]["initContainers"]
    env = env_values(render("cpu"), engine)
    mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    assert env["PAGEDSERVE_CACHE_DIR"] == mounts["cache"]
    assert {m["name"]: m["mountPath"] for m in seed["volumeMounts"]}["cache"] in seed["command"][-1]
    home = re.search(r"useradd .*--create-home .*?(\w+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert f"/home/{home}/.cache/pagedserve/." in seed["command"][-1]  # where cpu_kernels.warm built them


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_args_match_probes_ports_and_grace(overlay):
    docs = render(overlay)
    engine = main_container(docs, "StatefulSet")
    args = parse_args(engine)  # every flag exists
    assert args.health_host == "0.0.0.0"  # the kubelet probes the pod's IP
    probes = [engine[p]["grpc"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert {p["port"] for p in probes} == {args.health_port}
    assert [p["service"] for p in probes] == ["pagedserve.v1.Engine", "pagedserve.v1.Engine", ""]
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports["zmq"] == int(args.address.rsplit(":", 1)[1]) and args.address.startswith("tcp://0.0.0.0:")
    assert ports["metrics"] == args.metrics_port and args.metrics_host == "0.0.0.0"
    grace_s = one(docs, "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > args.drain_timeout_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontend_finds_the_headless_engine_service(overlay):
    docs = render(overlay)
    frontend = main_container(docs, "Deployment")
    host, port = flag(frontend["args"], "--engine-dns").rsplit(":", 1)
    service = one(docs, "Service", host)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    zmq_port = next(p for p in service["spec"]["ports"] if p["name"] == "zmq")
    engine_ports = {p["name"]: p["containerPort"] for p in main_container(docs, "StatefulSet")["ports"]}
    # DNS gives pod IPs, so the frontend dials the container port; the Service port must agree.
    assert int(port) == zmq_port["port"] == engine_ports[zmq_port["targetPort"]]
    ports = {p["name"]: p["containerPort"] for p in frontend["ports"]}
    assert int(flag(frontend["args"], "--grpc-port")) == ports["grpc"]
    assert int(flag(frontend["args"], "--http-port")) == ports["http"]
    assert int(flag(frontend["args"], "--metrics-port")) == ports["metrics"]
    assert {frontend[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {ports["grpc"]}
    assert frontend["readinessProbe"]["grpc"]["service"] == "pagedserve.v1.Generation"
    assert frontend["livenessProbe"]["grpc"]["service"] == ""
    exposed = {p["targetPort"] for p in one(docs, "Service", "pagedserve-frontend")["spec"]["ports"]}
    assert exposed == {"grpc", "http", "metrics"}
    pre_stop_s = int(frontend["lifecycle"]["preStop"]["exec"]["command"][1])
    grace_s = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop_s + float(flag(frontend["args"], "--drain-timeout-s")) < grace_s


def test_frontend_args_parse():
    args = parse_args(main_container(render("cpu"), "Deployment"))  # every flag exists
    assert args.host == "0.0.0.0" and args.engine_dns == "pagedserve-engine:5570" and not args.engine_address
    assert args.routing_policy == "cache_aware"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_frontends_reach_the_engine_port(overlay):
    docs = render(overlay)
    policy = one(docs, "NetworkPolicy", "pagedserve-engine")
    frontend_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    rules = [r for r in policy["spec"]["ingress"] if any(p["port"] in (5570, "zmq") for p in r.get("ports", []))]
    assert len(rules) == 1 and policy["spec"]["policyTypes"] == ["Ingress"]
    (peer,) = rules[0]["from"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"]["matchLabels"], frontend_labels)
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without `from` admits every source"
        assert all(set(p) <= {"podSelector", "namespaceSelector"} for p in rule["from"])


def test_cpu_and_gpu_variants():
    cpu, gpu = render("cpu"), render("gpu")
    cpu_engine, gpu_engine = main_container(cpu, "StatefulSet"), main_container(gpu, "StatefulSet")
    assert parse_args(cpu_engine).device == "cpu" and parse_args(gpu_engine).device == "cuda"
    assert cpu_engine["image"].endswith(":cpu") and gpu_engine["image"].endswith(":gpu")
    assert "nvidia.com/gpu" not in str(cpu)
    assert gpu_engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert parse_args(cpu_engine).model is None and parse_args(gpu_engine).model is None  # bundled, by default
    cpu_cache, gpu_cache = (hf_cache_claim(docs)["spec"]["resources"]["requests"]["storage"] for docs in (cpu, gpu))
    assert (cpu_cache, gpu_cache) == ("20Gi", "100Gi")  # room for the bigger models a GPU serves


# -- the model by name: ConfigMap, Hugging Face cache, token ---------------------------------

def hf_cache_claim(docs: list[dict]) -> dict:
    """The engine's volumeClaimTemplate mounted at its HF_HOME."""
    statefulset = one(docs, "StatefulSet")
    engine = containers(statefulset, init=False)[0]
    home = env_values(docs, engine)["HF_HOME"]
    (name,) = [m["name"] for m in engine["volumeMounts"] if m["mountPath"] == home]
    (claim,) = [c for c in statefulset["spec"].get("volumeClaimTemplates", []) if c["metadata"]["name"] == name]
    return claim


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_takes_its_model_from_the_config_map(overlay):
    """--model and --revision are $(VARS) from the ConfigMap pagedserve-model (kustomize's hashed
    name), empty by default: the bundled model, no download."""
    docs = render(overlay)
    engine = containers(one(docs, "StatefulSet"), init=False)[0]
    assert flag(engine["args"], "--model") == "$(PAGEDSERVE_MODEL)"
    assert flag(engine["args"], "--revision") == "$(PAGEDSERVE_MODEL_REVISION)"
    refs = {e["name"]: e["valueFrom"]["configMapKeyRef"] for e in engine["env"]
            if "configMapKeyRef" in e.get("valueFrom", {})}
    assert {name: ref["key"] for name, ref in refs.items()} == {
        "PAGEDSERVE_MODEL": "model", "PAGEDSERVE_MODEL_REVISION": "revision", "HF_HUB_OFFLINE": "hub-offline"}
    (config_map,) = {ref["name"] for ref in refs.values()}
    assert config_map.startswith("pagedserve-model-")  # a change of model rolls the engines
    assert one(docs, "ConfigMap", config_map)["data"] == {"model": "", "revision": "", "hub-offline": "0"}
    args = parse_args(main_container(docs, "StatefulSet"))
    assert args.model is None and args.revision is None


def test_a_model_set_by_an_overlay_reaches_the_engine(tmp_path):
    """The way the docs give: an overlay merging the model into the ConfigMap."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUBERNETES / "overlays" / "gpu", tmp_path)],  # kustomize wants it relative
        "configMapGenerator": [{"name": "pagedserve-model", "behavior": "merge",
                                "literals": ["model=Qwen/Qwen3-0.6B", "revision=v1.0", "hub-offline=1"]}]}))
    done = subprocess.run([*kustomize_command(), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    engine = main_container(docs, "StatefulSet")
    args = parse_args(engine)
    assert (args.model, args.revision, args.device) == ("Qwen/Qwen3-0.6B", "v1.0", "cuda")
    assert env_values(docs, engine)["HF_HUB_OFFLINE"] == "1"
    assert one(docs, "ConfigMap")["metadata"]["name"] != one(render("gpu"), "ConfigMap")["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hugging_face_cache_is_a_volume_per_engine(overlay):
    """HF_HOME is a volume of each engine's own (volumeClaimTemplates): a restarted or
    rescheduled engine finds its download. Frontends download nothing."""
    docs = render(overlay)
    claim = hf_cache_claim(docs)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert claim["metadata"]["name"] not in {v["name"] for v in pod["volumes"]}  # not an emptyDir
    assert "HF_TOKEN" not in {e["name"] for e in main_container(docs, "Deployment").get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hf_token_comes_from_an_optional_secret(overlay):
    docs = render(overlay)
    engine = containers(one(docs, "StatefulSet"), init=False)[0]
    (token,) = [e for e in engine["env"] if e["name"] == "HF_TOKEN"]
    assert set(token) == {"name", "valueFrom"}  # never a literal
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}
    assert not [d for d in docs if d["kind"] == "Secret"]  # the manifests carry no secret
    assert "HF_TOKEN" not in env_values(docs, engine)  # without the Secret: unset, the pod still starts


def test_engine_startup_allows_for_a_download():
    """The startup probe waits out a first start's download (kubelet restarts the pod after
    periodSeconds x failureThreshold)."""
    probe = main_container(render("cpu"), "StatefulSet")["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30 * 60


def test_keda_scales_the_engines_on_their_queue():
    docs = render("keda")
    scaled = one(docs, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    one(docs, target["kind"], target["name"])
    assert target["kind"] == "StatefulSet"
    assert "replicas" not in one(docs, "StatefulSet")["spec"]  # KEDA's HPA owns it
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "pagedserve:num_requests_waiting" in trigger["metadata"]["query"]
    assert one(render("cpu"), "StatefulSet")["spec"]["replicas"] >= 2  # without KEDA: a fixed count


# -- the engine as the manifest starts it ---------------------------------------------------

def local_args(args: list[str], free_port) -> tuple[list[str], dict[str, int]]:
    """The manifest's args on loopback, with free ports; (args, {flag: port})."""
    args, ports = list(args), {}
    for i, (name, value) in enumerate(zip(args, args[1:])):
        if name in ("--health-host", "--metrics-host", "--host"):
            args[i + 1] = "127.0.0.1"
        elif name in ("--health-port", "--metrics-port", "--grpc-port", "--http-port"):
            ports[name] = free_port()
            args[i + 1] = str(ports[name])
        elif name == "--address":
            ports[name] = free_port()
            args[i + 1] = f"tcp://127.0.0.1:{ports[name]}"
        elif name == "--num-threads":
            args[i + 1] = "1"  # the machine's cores are shared
    return args, ports


def probe(port: int, service: str) -> int | grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError as e:
            return e.code()


def wait_probe(port: int, service: str, want, proc, procs, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := probe(port, service)) != want:
        assert proc.poll() is None, f"exited:\n{procs.log_tail(proc)}"
        assert time.monotonic() < deadline, f"{service!r} is {got}, never {want}:\n{procs.log_tail(proc)}"
        time.sleep(0.1)


def test_pods_run_as_the_manifests_say(procs):
    """Engine and frontend from the cpu overlay's args (on loopback, free ports): their probes
    answer as the kubelet wants, then SIGTERM stops each within its grace period."""
    docs = render("cpu")
    engine_pod, frontend_pod = one(docs, "StatefulSet"), one(docs, "Deployment")
    engine, frontend = main_container(docs, "StatefulSet"), main_container(docs, "Deployment")
    args, ports = local_args(engine["args"], procs.free_port)
    engine_proc = procs.drain(procs.pagedserve(*args, "--num-kv-blocks", "256"))
    frontend_proc = None
    try:
        startup_s = engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"]
        wait_probe(ports["--health-port"], engine["startupProbe"]["grpc"]["service"], SERVING, engine_proc, procs,
                   timeout_s=min(startup_s, 90))
        for name in ("readinessProbe", "livenessProbe"):
            assert probe(ports["--health-port"], engine[name]["grpc"]["service"]) == SERVING

        # --engine-dns HOST:PORT, with HOST the loopback address instead of the Service's name
        fe_args, fe_ports = local_args(frontend["args"], procs.free_port)
        dns = fe_args.index("--engine-dns") + 1
        fe_args[dns] = f"127.0.0.1:{ports['--address']}"
        frontend_proc = procs.drain(procs.pagedserve(*fe_args))
        grpc_port = fe_ports["--grpc-port"]
        wait_probe(grpc_port, frontend["startupProbe"]["grpc"]["service"], SERVING, frontend_proc, procs, 60)
        wait_probe(grpc_port, frontend["readinessProbe"]["grpc"]["service"], SERVING, frontend_proc, procs, 60)
        assert probe(grpc_port, frontend["livenessProbe"]["grpc"]["service"]) == SERVING

        for pod, proc in ((frontend_pod, frontend_proc), (engine_pod, engine_proc)):  # as the kubelet stops pods
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]) == 0, \
                procs.log_tail(proc)
    finally:
        for proc in (frontend_proc, engine_proc):
            if proc is not None:
                procs.stop(proc)
