"""What the Kubernetes manifests promise beyond their schemas: least privilege for the handles in
use, one GPU claim shared the way each topology needs, the token as a Secret, probes, budgets,
monitoring and network policy covering every pod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kubernetes_files import (
    DAEMON_IMAGE_CONTAINERS,
    ENGINE_IMAGE_CONTAINERS,
    NODE_ENGINE_CACHE,
    PREREQUISITES,
    PROXY_CONTAINERS,
    RUN_DIR,
    TOPOLOGIES,
    Pod,
    arg_after,
    env_of,
    pods,
    rendered,
)

PODS = pods()
CUDA_CONTAINERS = {"daemon", "keeper", "engine", "engine-b"}


def pod_ids(pod: Pod) -> str:
    return pod.name


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def of_kind(topology: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in rendered(topology) if r["kind"] == kind]


def uses_fd_handles(pod: Pod) -> bool:
    daemon = pod.container("daemon")
    return daemon is None or env_of(daemon).get("WEIGHT_CACHE_CUDA_HANDLES") == "fd"


def test_every_topology_runs_a_daemon_and_an_engine() -> None:
    for topology in TOPOLOGIES:
        names = {c["name"] for p in PODS if p.topology == topology for c in p.containers()}
        assert {"daemon", "engine"} <= names, topology


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_pod_runs_unprivileged(pod: Pod) -> None:
    spec = pod.spec
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert spec["automountServiceAccountToken"] is False  # nothing here talks to the API server
    context = spec["securityContext"]
    assert context["runAsNonRoot"] is True
    # the images' user (docker/Dockerfile), which owns the run directory and reads the token
    assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == 10001
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod.containers():
        known = DAEMON_IMAGE_CONTAINERS | ENGINE_IMAGE_CONTAINERS | PROXY_CONTAINERS
        assert container["name"] in known
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert not security.get("privileged")
        resources = container["resources"]
        for kind in ("cpu", "memory"):  # requests = limits: the pod's QoS is Guaranteed
            assert resources["requests"][kind] == resources["limits"][kind], container["name"]


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_host_paths_only_for_the_run_directory_and_the_engine_cache(pod: Pod) -> None:
    """The node cache's run directory (its sockets pass descriptors) and its engines' cache are
    the only host paths, both prepared beforehand (``Directory``: one the kubelet created would
    be root's); an engine mounts the run directory read-only (connecting to a socket needs no
    write access)."""
    allowed = {RUN_DIR, NODE_ENGINE_CACHE}
    for volume in pod.spec.get("volumes", []):
        if "hostPath" in volume:
            assert pod.topology == "node-cache"
            assert volume["hostPath"]["path"] in allowed
            assert volume["hostPath"]["type"] == "Directory"
    for container in pod.containers():
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] == RUN_DIR:
                read_only = container["name"] in ENGINE_IMAGE_CONTAINERS
                assert mount.get("readOnly", False) is read_only, container["name"]


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_process_namespace_shared_only_for_legacy_ipc(pod: Pod) -> None:
    legacy = not uses_fd_handles(pod)
    assert bool(pod.spec.get("shareProcessNamespace")) is legacy
    assert legacy == (pod.topology == "sidecar-legacy-ipc")
    daemon = pod.container("daemon")
    if daemon is not None:
        # legacy IPC memory dies with the daemon's process: no keeper to hold it
        assert (pod.container("keeper") is None) is legacy
        expected = "off" if legacy else "external"
        assert env_of(daemon)["WEIGHT_CACHE_KEEPER"] == expected


DEVICE_PLUGIN = "sidecar-device-plugin"
DEVICE_PLUGIN_GPU = "nvidia.com/gpu"


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_one_gpu_claim_for_every_cuda_container(pod: Pod) -> None:
    if pod.topology == DEVICE_PLUGIN:
        pytest.skip("no DRA claim on the device plugin: test_device_plugin_variant")
    declared = {c["name"]: c for c in pod.spec.get("resourceClaims", [])}
    named = {
        c["name"]: {claim["name"] for claim in c["resources"].get("claims", [])}
        for c in pod.containers()
    }
    for name, claims in named.items():
        assert claims == (set(declared) if name in CUDA_CONTAINERS else set()), name
    assert len(declared) == (1 if set(named) & CUDA_CONTAINERS else 0)
    kinds = {
        "ResourceClaim": "resourceClaimName",
        "ResourceClaimTemplate": "resourceClaimTemplateName",
    }
    objects = {
        (r["kind"], r["metadata"]["name"]): r for r in rendered(pod.topology) if r["kind"] in kinds
    }
    for claim in declared.values():
        (kind,) = [k for k, field in kinds.items() if field in claim]
        assert (kind, claim[kinds[kind]]) in objects, claim


def _requests(topology: str, kind: str, name: str) -> list[dict[str, Any]]:
    (claim,) = [r for r in of_kind(topology, kind) if r["metadata"]["name"] == name]
    spec = claim["spec"]["spec"] if kind == "ResourceClaimTemplate" else claim["spec"]
    requests: list[dict[str, Any]] = spec["devices"]["requests"]
    return [r["exactly"] for r in requests]


def test_sidecar_pod_claims_one_gpu_for_all_its_containers() -> None:
    pod = next(p for p in PODS if p.topology == "sidecar")
    (claim,) = pod.spec["resourceClaims"]
    (request,) = _requests("sidecar", "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    assert request["allocationMode"] == "ExactCount" and request["count"] == 1
    assert not request.get("adminAccess")


def test_node_cache_shares_the_node_gpus_between_daemon_and_engines() -> None:
    """The daemon sees its node's GPUs with admin access (they stay free for the engines); the
    engines share one ResourceClaim of all the node's GPUs, so GPU r is the same on both sides."""
    daemon = next(p for p in PODS if p.topology == "node-cache" and p.container("daemon"))
    engine = next(p for p in PODS if p.topology == "node-cache" and p.container("engine"))
    assert daemon.workload["kind"] == "DaemonSet" and engine.workload["kind"] == "Deployment"
    (claim,) = daemon.spec["resourceClaims"]
    (request,) = _requests(
        "node-cache", "ResourceClaimTemplate", claim["resourceClaimTemplateName"]
    )
    assert request["adminAccess"] is True and request["allocationMode"] == "All"
    (namespace,) = of_kind("node-cache", "Namespace")
    assert namespace["metadata"]["labels"]["resource.kubernetes.io/admin-access"] == "true"
    (claim,) = engine.spec["resourceClaims"]
    (request,) = _requests("node-cache", "ResourceClaim", claim["resourceClaimName"])
    assert request["allocationMode"] == "All" and not request.get("adminAccess")
    assert (
        request["deviceClassName"]
        == _requests(
            "node-cache",
            "ResourceClaimTemplate",
            daemon.spec["resourceClaims"][0]["resourceClaimTemplateName"],
        )[0]["deviceClassName"]
    )
    for pod in (daemon, engine):  # GPU r numbered alike on both sides
        for name in ("daemon", "engine"):
            container = pod.container(name)
            if container is not None:
                assert env_of(container)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_namespaces_and_their_pod_security() -> None:
    for topology in TOPOLOGIES:
        names = {n["metadata"]["name"]: n for n in of_kind(topology, "Namespace")}
        for resource in rendered(topology):
            if resource["kind"] != "Namespace":
                assert resource["metadata"]["namespace"] in names, resource["metadata"]
        for namespace in names.values():
            labels = namespace["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/warn"] == "restricted"
            assert labels["pod-security.kubernetes.io/audit"] == "restricted"
            # only the node cache's host path needs more than Restricted
            expected = "privileged" if topology == "node-cache" else "restricted"
            assert labels["pod-security.kubernetes.io/enforce"] == expected


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_token_is_a_secret_file(pod: Pod) -> None:
    mounted = None
    for container in pod.containers():
        for mount in container.get("volumeMounts", []):
            volume = pod.volume(mount["name"])
            if "secret" in volume:
                assert volume["secret"]["secretName"] == "weight-cache-token"
                assert volume["secret"]["defaultMode"] == 0o440  # the group 10001 reads it
                assert mount["readOnly"] is True
                mounted = f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
        assert "WEIGHT_CACHE_TOKEN" not in env_of(container)  # never the value itself
    daemon, engine = pod.container("daemon"), pod.container("engine")
    if daemon is not None:
        assert env_of(daemon)["WEIGHT_CACHE_TOKEN_FILE"] == mounted
    if engine is not None:
        extra = json.loads(arg_after(engine["args"], "--model-loader-extra-config"))
        assert extra["token_file"] == mounted
    for topology in TOPOLOGIES:  # the operator creates it: no token in the repository
        assert not of_kind(topology, "Secret")


def _probe(container: dict[str, Any], kind: str) -> tuple[str, str] | None:
    probe = container.get(kind)
    if probe is not None and "tcpSocket" in probe:
        return ("tcp", probe["tcpSocket"]["port"])
    return None if probe is None else (probe["httpGet"]["path"], probe["httpGet"]["port"])


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_probes(pod: Pod) -> None:
    """The daemon: /health is liveness, /ready readiness, and a start-up probe on /ready sized
    for the first load (in the sidecar pod it is what holds the engine back, and the pod's
    readiness is the engine's, which keeps serving while its daemon restarts). The engine: vLLM's
    /health. The keeper serves no HTTP and has none: a failed probe would restart it and drop the
    allocations it exists to keep."""
    for container in pod.containers():
        name = container["name"]
        probes = {
            k: _probe(container, k) for k in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        if name == "daemon":
            assert probes["livenessProbe"] == ("/health", "wc-http")
            assert probes["startupProbe"] == ("/ready", "wc-http")
            sidecar = container.get("restartPolicy") == "Always"
            assert probes["readinessProbe"] == (None if sidecar else ("/ready", "wc-http"))
        elif name == "engine":
            assert set(probes.values()) == {("/health", "http")}
        elif name == "engine-b":
            assert set(probes.values()) == {("/health", "http-b")}
        elif name in PROXY_CONTAINERS:  # Caddy listening; the engines' health is its own check
            assert probes["livenessProbe"] == probes["readinessProbe"] == ("tcp", "proxy")
        else:
            assert set(probes.values()) == {None}, name


def test_sidecar_pod_starts_keeper_then_daemon_then_engine() -> None:
    for pod in PODS:
        if not pod.topology.startswith("sidecar"):
            continue
        check, *init = pod.spec["initContainers"]  # the prerequisites run to their end first
        assert check["name"] == PREREQUISITES and "restartPolicy" not in check
        sidecars = [c["name"] for c in init]
        assert all(c.get("restartPolicy") == "Always" for c in init)
        assert sidecars == (
            ["daemon"] if pod.topology == "sidecar-legacy-ipc" else ["keeper", "daemon"]
        )
        warm = pod.topology == "sidecar-warm-standby"
        expected = ["engine", "engine-b", "proxy"] if warm else ["engine"]
        assert [c["name"] for c in pod.spec["containers"]] == expected
        assert pod.workload["spec"]["replicas"] == 1
        assert pod.workload["spec"]["strategy"] == {"type": "Recreate"}  # the GPU frees first


def test_node_cache_daemon_upgrades_in_place() -> None:
    """A new DaemonSet template never replaces a running pod: that would take the keeper, and
    the allocations it holds, with it (README.md there: "Upgrading the daemon")."""
    (daemonset,) = of_kind("node-cache", "DaemonSet")
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    keeper = daemonset["spec"]["template"]["spec"]["initContainers"][1]
    assert keeper["name"] == "keeper" and keeper["restartPolicy"] == "Always"


def test_engines_sharing_a_gpu_roll_one_at_a_time() -> None:
    (deployment,) = of_kind("node-cache", "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_disruption_budgets_where_they_apply(topology: str) -> None:
    """Every Deployment of several engines has a budget that lets one go at a time; one engine
    alone (it restarts in place) and DaemonSet pods (drains leave them) have none."""
    budgets = of_kind(topology, "PodDisruptionBudget")
    covered = []
    for deployment in of_kind(topology, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        mine = [b for b in budgets if labels_match(b["spec"]["selector"]["matchLabels"], labels)]
        replicas = deployment["spec"]["replicas"]
        assert len(mine) == (1 if replicas > 1 else 0), deployment["metadata"]["name"]
        for budget in mine:
            assert 0 < budget["spec"]["minAvailable"] < replicas
            assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
            covered.append(budget)
    assert len(covered) == len(budgets)


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_scrape_annotations_name_a_port_of_the_pod(pod: Pod) -> None:
    annotations = pod.template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    ports = {p["containerPort"] for c in pod.containers() for p in c.get("ports", [])}
    assert int(annotations["prometheus.io/port"]) in ports


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_network_policy_covers_the_pod(pod: Pod) -> None:
    labels = pod.template["metadata"]["labels"]
    policies = [
        p
        for p in of_kind(pod.topology, "NetworkPolicy")
        if labels_match(p["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert len(policies) == 1
    (policy,) = policies
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["spec"]["egress"] == []  # nothing here calls out
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    ports = {
        p["containerPort"]
        for c in pod.containers()
        if not is_warm_standby(c)  # vLLM's development endpoints: reached through the proxy
        for p in c.get("ports", [])
    }
    assert allowed == ports


def is_warm_standby(container: dict[str, Any]) -> bool:
    command: list[str] = container.get("command", [])
    return command[:2] == ["weight-cache", "standby"]


def test_warm_standby_variant() -> None:
    """Both engines under `weight-cache standby` with vLLM's sleep mode, alike but for their
    port; Caddy in front on docker/Caddyfile (the same text), healthy only while awake, three
    checks in a row; the Service on the proxy."""
    from engine_client.engine_api import SLEEP_FLAG

    (pod,) = [p for p in PODS if p.topology == "sidecar-warm-standby"]
    engines = [c for c in pod.containers() if c["name"] in ("engine", "engine-b")]
    for engine in engines:
        assert is_warm_standby(engine) and SLEEP_FLAG in engine["args"], engine["name"]
        assert engine["command"][-3:] == ["--", "vllm", "serve"]
    ports = [e["args"][e["args"].index("--port") + 1] for e in engines]
    assert ports == ["8000", "8001"]
    (proxy,) = [c for c in pod.containers() if c["name"] == "proxy"]
    env = {e["name"]: e["value"] for e in proxy["env"]}
    assert env["ENGINE_UPSTREAMS"] == "127.0.0.1:8000 127.0.0.1:8001"
    assert (env["PROXY_HEALTH_URI"], env["PROXY_HEALTH_BODY"]) == ("/is_sleeping", "false")
    assert env["PROXY_HEALTH_PASSES"] == "3"
    (config,) = list(of_kind(pod.topology, "ConfigMap"))
    caddyfile = Path(__file__).resolve().parents[2] / "docker" / "Caddyfile"
    assert config["data"]["Caddyfile"] == caddyfile.read_text()
    (service,) = of_kind(pod.topology, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "proxy"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_services_reach_engines(topology: str) -> None:
    for service in of_kind(topology, "Service"):
        selected = [
            p
            for p in PODS
            if p.topology == topology
            and labels_match(service["spec"]["selector"], p.template["metadata"]["labels"])
        ]
        assert [p.workload["kind"] for p in selected] == ["Deployment"]
        names = {port["name"] for c in selected[0].containers() for port in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_device_plugin_variant() -> None:
    """The sidecar pod on NVIDIA's device plugin: no DRA object or claim anywhere, one
    nvidia.com/gpu for the daemon and one for the engine (a time-sliced GPU shared by both, on
    single-GPU nodes), none for the keeper; otherwise the sidecar's pod as it is."""
    resources = rendered(DEVICE_PLUGIN)
    assert not [r for r in resources if r["apiVersion"].startswith("resource.k8s.io/")]
    (pod,) = [p for p in PODS if p.topology == DEVICE_PLUGIN]
    (sidecar,) = [p for p in PODS if p.topology == "sidecar"]
    assert "resourceClaims" not in pod.spec
    assert pod.spec["nodeSelector"] == {"nvidia.com/gpu.count": "1"}
    for container in pod.containers():
        resources_of = container["resources"]
        assert "claims" not in resources_of, container["name"]
        gpus = {k: v.get(DEVICE_PLUGIN_GPU) for k, v in resources_of.items()}
        wanted = "1" if container["name"] in {"daemon", "engine"} else None
        assert gpus == {"requests": wanted, "limits": wanted}, container["name"]
        base = sidecar.container(container["name"])
        assert base is not None
        assert {k: v for k, v in container.items() if k != "resources"} == {
            k: v for k, v in base.items() if k != "resources"
        }
