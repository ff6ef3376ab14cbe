"""The shipped manifests agree with the code.

* the KubeSchedulerConfiguration's extender verbs, resource name and port match the extender's routes,
  its container and its Service; its Lease matches the extender's ``--lease``, the RBAC and the
  identity the extender fences with;
* the DaemonSet's flags are accepted by the device plugin and it mounts, at the host's own paths,
  what the plugin's settings then use (kubelet's directories, the MPS root, the CDI spec directories);
* the shared config and the price table validate, joined as the extender reads them;
* the admission policy names the service accounts the pods run as; RBAC is exactly what each needs;
* alerts and the dashboard use series the code exports; the image and the Makefile are what the
  README says.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from gpuslice.config import load_config_text
from gpuslice.requests import RESOURCE, parse_request
from tests.manifests.built import (
    EXAMPLES,
    MANIFESTS,
    NAMESPACE,
    NEWEST,
    OLDEST,
    OVERLAYS,
    REPO,
    Obj,
    build,
    examples,
    named_prefix,
    one,
)

SCHEDULER_CONFIG = MANIFESTS / "scheduler" / "scheduler-config.yaml"
PROFILE = "gpu-slice-scheduler"


def _container(pod_spec: Obj, name: str) -> Obj:
    (c,) = [c for c in pod_spec["containers"] + pod_spec.get("initContainers", []) if c["name"] == name]
    return c


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def _mounts(pod_spec: Obj, container: Obj) -> dict[str, Obj]:
    """Container mount path -> the volume it mounts."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["volumeName"] if "volumeName" in m else m["name"]]
            for m in container.get("volumeMounts", [])}


def _mounted_at(pod_spec: Obj, container: Obj, path: PurePosixPath) -> tuple[PurePosixPath, Obj]:
    """The deepest mount that holds ``path``: its mount path and volume."""
    best: tuple[PurePosixPath, Obj] | None = None
    for mount_path, volume in _mounts(pod_spec, container).items():
        mp = PurePosixPath(mount_path)
        if (path == mp or mp in path.parents) and (best is None or len(mp.parts) > len(best[0].parts)):
            best = (mp, volume)
    assert best is not None, f"{path} is not on any volume of container {container['name']}"
    return best


def _scheduler(objs: list[Obj]) -> tuple[Obj, Obj]:
    dep = one(objs, "Deployment", "gpu-slice-scheduler")
    cm = named_prefix(objs, "ConfigMap", "gpu-slice-scheduler-config")
    return dep, yaml.safe_load(cm["data"]["scheduler-config.yaml"])


# ---- the scheduler profile and the extender ---------------------------------------------------------

def test_kube_scheduler_retries_pods_the_extender_refused_within_a_minute() -> None:
    """An extender's refusal has no queueing hint, so kube-scheduler must flush its unschedulable pods
    often (the 5-minute default left a pod Pending after its slices were freed: e2e scenario 7)."""
    dep, _ = _scheduler(build("simulated"))
    (sched,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kube-scheduler"]
    (flag,) = [f for f in sched["command"] if f.startswith("--pod-max-in-unschedulable-pods-duration=")]
    assert flag.split("=", 1)[1] == "30s"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scheduler_config_matches_the_extender(overlay: str) -> None:
    from extender import cli
    from extender.app import build_ops_app, build_verbs_app
    from extender.binder import MemoryBinder
    from extender.service import Extender
    from gpuslice.config import default_config

    objs = build(overlay, monitoring=True)
    dep, config = _scheduler(objs)
    assert config == yaml.safe_load(SCHEDULER_CONFIG.read_text()), "the ConfigMap is scheduler-config.yaml"
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["percentageOfNodesToScore"] == 100
    assert [p["schedulerName"] for p in config["profiles"]] == [PROFILE]
    (ext,) = config["extenders"]
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False and ext["weight"] > 0
    assert ext["managedResources"] == [{"name": RESOURCE, "ignoredByScheduler": False}]

    # Every verb is a POST route of the extender's verbs app, at urlPrefix + "/" + verb; the probes and
    # metrics are on the ops app, and neither app serves the other's routes.
    ext_obj = Extender(default_config(), MemoryBinder([]))
    routes = {r.path: r.methods for r in build_verbs_app(ext_obj).routes}  # type: ignore[attr-defined]
    ops = {r.path: r.methods for r in build_ops_app(ext_obj).routes}  # type: ignore[attr-defined]
    assert not set(routes) & set(ops)
    url = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", ext["urlPrefix"])
    assert url, ext["urlPrefix"]
    for key in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb"):
        assert "POST" in routes[f"/{ext[key]}"], key

    # The verbs listen on loopback at urlPrefix's port, declared nowhere; probes, the Service, the
    # monitor and the NetworkPolicy use the ops port, and only it.
    pod = dep["spec"]["template"]["spec"]
    extender = _container(pod, "extender")
    assert extender["args"][0] == "extender"
    port = int(url.group(1))
    assert int(_flag(extender["args"], "port")) == port
    assert _flag(extender["args"], "address") == "127.0.0.1"
    ops_port = int(_flag(extender["args"], "ops-port"))
    assert ops_port != port and _flag(extender["args"], "ops-address") == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in extender["ports"]}
    assert ports == {"metrics": ops_port}
    assert extender["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"} and "GET" in ops["/readyz"]
    assert extender["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"} and "GET" in ops["/healthz"]
    assert "GET" in ops["/metrics"]
    svc = one(objs, "Service", "gpu-slice-scheduler-metrics")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in ("metrics", ops_port)
    monitor = one(objs, "ServiceMonitor", "gpu-slice-scheduler")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {svc_port["name"]}
    netpol = one(objs, "NetworkPolicy", "gpu-slice-scheduler")
    assert [p["port"] for r in netpol["spec"]["ingress"] for p in r["ports"]] == [ops_port]
    # The shipped flags pass the extender's own start-up checks (verbs off loopback need client certs).
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([a for a in extender["args"][1:] if not a.startswith("--config=")])
    settings = cli.build_settings(args)
    assert (settings.address, settings.port, settings.ops_port) == ("127.0.0.1", port, ops_port)

    # kube-scheduler reads the mounted config.
    sched = _container(pod, "kube-scheduler")
    path = PurePosixPath(_flag(sched["command"], "config"))
    mount, volume = _mounted_at(pod, sched, path)
    assert volume["configMap"]["name"] == named_prefix(objs, "ConfigMap", "gpu-slice-scheduler-config")[
        "metadata"]["name"]
    assert str(path.relative_to(mount)) == "scheduler-config.yaml"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_leader_election_lease_is_the_one_the_extender_fences_on(overlay: str) -> None:
    from extender import cli

    objs = build(overlay)
    dep, config = _scheduler(objs)
    election = config["leaderElection"]
    assert election["leaderElect"] is True and election["resourceLock"] == "leases"
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    extender = _container(pod, "extender")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(extender["args"][1:])
    assert args.lease == f"{election['resourceNamespace']}/{election['resourceName']}"
    assert not args.no_fencing
    # kube-scheduler's identity is <hostname>_<uuid>; a pod's host name is its name.
    assert args.identity == "$(POD_NAME)"
    env = {e["name"]: e for e in extender["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # kube-scheduler's account may read and renew exactly that Lease; the extender's (the pod's) may read it.
    reader = {"get", "list", "watch"}
    for role_name, account, verbs in (("gpu-slice-scheduler-lease", "gpu-slice-scheduler", reader | {"update"}),
                                      ("gpu-slice-extender-lease", pod["serviceAccountName"], reader)):
        role = one(objs, "Role", role_name)
        assert role["metadata"]["namespace"] == election["resourceNamespace"]
        (rule,) = role["rules"]
        assert rule["resources"] == ["leases"] and rule["resourceNames"] == [election["resourceName"]]
        assert set(rule["verbs"]) == verbs
        binding = one(objs, "RoleBinding", role_name)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_extender_config_is_the_shared_config_and_the_price_table_joined(overlay: str, tmp_path: Path) -> None:
    from extender import cli

    objs = build(overlay)
    dep, _ = _scheduler(objs)
    pod = dep["spec"]["template"]["spec"]
    shared = named_prefix(objs, "ConfigMap", "gpu-slice-config")["data"]["config.yaml"]
    prices = named_prefix(objs, "ConfigMap", "gpu-slice-prices")["data"]["prices.yaml"]
    # The init container joins the two files into the path the extender reads.
    join = _container(pod, "join-config")
    script = join["command"][-1]
    words = shlex.split(script)
    assert words[0] == "cat" and words[-2] == ">"
    extender = _container(pod, "extender")
    target = _flag(extender["args"], "config")
    assert words[-1] == target
    (_, run_volume) = _mounted_at(pod, join, PurePosixPath(target))
    (_, seen_volume) = _mounted_at(pod, extender, PurePosixPath(target))
    assert run_volume is seen_volume and "emptyDir" in run_volume
    sources = []
    for src in words[1:-2]:
        mount, volume = _mounted_at(pod, join, PurePosixPath(src))
        name = volume["configMap"]["name"]
        (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
        sources.append(cm["data"][str(PurePosixPath(src).relative_to(mount))])
    assert sources == [shared, prices]
    config = load_config_text("".join(sources))
    assert config.prices.gpu_hourly and config.slices == 7
    # The extender starts with these flags and that file.
    (tmp_path / "config.yaml").write_text("".join(sources))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([a if not a.startswith("--config=") else f"--config={tmp_path / 'config.yaml'}"
                              for a in extender["args"][1:]])
    settings = cli.build_settings(args)
    assert settings.config.prices == config.prices


# ---- the device plugin ------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_mounts_what_the_plugin_settings_use(overlay: str, tmp_path: Path) -> None:
    from deviceplugin import cli
    from deviceplugin.settings import build as build_settings

    objs = build(overlay, monitoring=True)
    ds = one(objs, "DaemonSet", "gpu-slice-device-plugin")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][0] == "device-plugin"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    config_path = PurePosixPath(args.config)
    mount, volume = _mounted_at(pod, container, config_path)
    cm = named_prefix(objs, "ConfigMap", "gpu-slice-config")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    local_config = tmp_path / "config.yaml"
    local_config.write_text(cm["data"][str(config_path.relative_to(mount))])
    flags = {k: v for k, v in vars(args).items() if k != "log_level"}
    flags["config"] = str(local_config)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    s = build_settings(flags, env={"NODE_NAME": "gpu-node-1"})
    assert s.backend == {"nvidia": "nvml", "simulated": "simulated"}[overlay]

    def on_host_at_same_path(path: Path, *, file_parent: bool = False) -> None:
        p = PurePosixPath(path.parent if file_parent else path)
        mp, vol = _mounted_at(pod, container, p)
        assert "hostPath" in vol, f"{p} must be a host path (kubelet and pods see it)"
        assert PurePosixPath(vol["hostPath"]["path"]) / p.relative_to(mp) == p, f"{p} is not at the host's path"

    on_host_at_same_path(s.plugin_dir)                      # our socket; kubelet.sock beside it
    on_host_at_same_path(s.pod_resources_socket, file_parent=True)
    on_host_at_same_path(s.mps_dir)                         # Allocate hands pods host paths under it
    if s.backend == "nvml" and s.device_injection == "cdi":
        for d in s.cdi_spec_dirs:
            on_host_at_same_path(d)
    # /metrics and /healthz on the declared port, probed by kubelet.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == s.metrics_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    podmon = one(objs, "PodMonitor", "gpu-slice-device-plugin")
    assert podmon["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert {e["port"] for e in podmon["spec"]["podMetricsEndpoints"]} == {"metrics"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_placement(overlay: str) -> None:
    ds = one(build(overlay), "DaemonSet", "gpu-slice-device-plugin")
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    tolerated = {t["key"] for t in pod["tolerations"] if t["operator"] == "Exists" and "effect" not in t}
    assert {"nvidia.com/gpu", "cloud.google.com/gke-spot", "cloud.google.com/gke-preemptible",
            "karpenter.sh/capacity-type", "kubernetes.azure.com/scalesetpriority",
            "example.com/gpu-slice-conflict"} <= tolerated
    if overlay == "nvidia":
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        keys = {e["key"] for t in terms for e in t["matchExpressions"]}
        assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
        assert pod["hostPID"] is True and pod["containers"][0]["securityContext"]["privileged"] is True
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    else:
        assert pod["nodeSelector"] == {"example.com/gpu-slice.simulated": "true"}
        assert not pod.get("hostPID") and not pod["containers"][0]["securityContext"].get("privileged")


# ---- who may do what --------------------------------------------------------------------------------

def _rules(objs: list[Obj], name: str) -> set[tuple[str, str, str]]:
    role = one(objs, "ClusterRole", name)
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_rbac_is_least_privilege() -> None:
    objs = build("nvidia")
    assert _rules(objs, "gpu-slice-device-plugin") == {
        *{("", "pods", v) for v in ("get", "list", "watch", "patch")},
        *{("", "nodes", v) for v in ("get", "list", "watch", "patch")},
        ("", "events", "create")}
    assert _rules(objs, "gpu-slice-extender") == {
        *{("", "nodes", v) for v in ("get", "list", "watch")},
        *{("", "pods", v) for v in ("get", "list", "watch", "patch")},
        ("", "pods/binding", "create"), ("", "pods/eviction", "create"), ("", "events", "create"),
        *{("policy", "poddisruptionbudgets", v) for v in ("list", "watch")}}
    # Dynamic MIG layouts: node patches, held by the mig-layout policy to one annotation.
    assert _rules(objs, "gpu-slice-extender-mig-layouts") == {("", "nodes", "patch")}
    for o in objs:
        for rule in o.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule.get("resources", []), o["metadata"]["name"]
            assert "secrets" not in rule.get("resources", []), o["metadata"]["name"]
    # The slice map's readers get one read-only path, nothing else.
    assert one(objs, "ClusterRole", "gpu-slice-slicemap-reader")["rules"] == [
        {"nonResourceURLs": ["/slicemap", "/slicemap/*"], "verbs": ["get"]}]
    bound = {(b["roleRef"]["name"], s["name"]) for b in objs if b["kind"] == "ClusterRoleBinding"
             for s in b["subjects"]}
    # kube-scheduler's rights go to its own account, never to the extender's, and the other way round.
    assert bound == {("gpu-slice-device-plugin", "gpu-slice-device-plugin"),
                     ("gpu-slice-extender", "gpu-slice-extender"),
                     ("system:kube-scheduler", "gpu-slice-scheduler"),
                     ("system:volume-scheduler", "gpu-slice-scheduler"),
                     # TokenReview and SubjectAccessReview for the slice map's bearer tokens (the extender's)
                     ("system:auth-delegator", "gpu-slice-extender"),
                     ("gpu-slice-extender-mig-layouts", "gpu-slice-extender")}
    # Each container of the scheduler pod mounts its own account's token, and no other.
    dep = one(objs, "Deployment", "gpu-slice-scheduler")
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "gpu-slice-extender"
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    mounted = {c["name"]: [m["name"] for m in c["volumeMounts"] if m["mountPath"] == token_path]
               for c in pod["containers"]}
    assert mounted == {"kube-scheduler": ["scheduler-token"], "extender": ["extender-token"]}
    assert any("serviceAccountToken" in s for s in volumes["extender-token"]["projected"]["sources"])
    secret = one(objs, "Secret", volumes["scheduler-token"]["secret"]["secretName"])
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == "gpu-slice-scheduler"


def test_admission_policy_names_the_service_accounts_the_pods_run_as() -> None:
    objs = build("nvidia")
    text = json.dumps([o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"])
    named = set(re.findall(r"system:serviceaccount:([a-z0-9-]+):([a-z0-9-]+)", text))
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs if o["kind"] == "ServiceAccount"}
    used = {(NAMESPACE, one(objs, kind, name)["spec"]["template"]["spec"]["serviceAccountName"])
            for kind, name in (("DaemonSet", "gpu-slice-device-plugin"), ("Deployment", "gpu-slice-scheduler"))}
    # The policies name exactly the accounts the plugin and the extender run as; kube-scheduler's own
    # account (gpu-slice-scheduler) may write none of gpu-slice's annotations.
    assert named == used and accounts == used | {(NAMESPACE, "gpu-slice-scheduler")}
    policies = {o["metadata"]["name"] for o in objs if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {o["spec"]["policyName"] for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert policies == bindings == {"gpu-slice-annotations", "gpu-slice-assignments-in-bindings",
                                    "gpu-slice-services-write-only-their-annotations",
                                    "gpu-slice-scheduled-slice-pods", "gpu-slice-device-plugin-own-node",
                                    "gpu-slice-requests", "gpu-slice-slice-pods", "gpu-slice-mig-layouts"}
    # Every path a pod's annotations can be written by is matched.
    matched = {r for o in objs if o["kind"] == "ValidatingAdmissionPolicy"
               for rule in o["spec"]["matchConstraints"]["resourceRules"] for r in rule["resources"]}
    assert {"pods", "pods/status", "pods/binding"} <= matched


def test_every_namespaced_object_is_in_the_project_namespace_or_the_lease_namespace() -> None:
    objs = build("nvidia")
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding"}
    for o in objs:
        where = o["metadata"].get("namespace")
        assert (where is None) == (o["kind"] in cluster_scoped), f"{o['kind']} {o['metadata']['name']}: {where}"
        assert where in (None, NAMESPACE, "kube-system")
    in_kube_system = {(o["kind"], o["metadata"]["name"]) for o in objs
                      if o["metadata"].get("namespace") == "kube-system"}
    assert in_kube_system == {("Role", "gpu-slice-scheduler-lease"), ("RoleBinding", "gpu-slice-scheduler-lease"),
                              ("Role", "gpu-slice-extender-lease"), ("RoleBinding", "gpu-slice-extender-lease"),
                              ("RoleBinding", "gpu-slice-scheduler-authentication-reader")}
    ns = one(objs, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# ---- metrics ----------------------------------------------------------------------------------------

def _exported_series() -> set[str]:
    from prometheus_client import CollectorRegistry

    from deviceplugin.metrics import PluginMetrics, SliceCollector
    from deviceplugin.pod_series import PodSeriesCollector
    from extender.metrics import ExtenderMetrics

    names: set[str] = set()
    registry = CollectorRegistry()
    PluginMetrics(registry)
    ext = ExtenderMetrics()
    from extender.status_gauges import StatusGauges

    families = [*registry.collect(), *ext.registry.collect(), *SliceCollector(lambda: None).describe(),  # type: ignore[arg-type,return-value]
                *PodSeriesCollector("n", lambda: None, dict).describe(),  # type: ignore[arg-type,return-value]
                *StatusGauges(None).describe()]  # type: ignore[arg-type]
    for fam in families:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count")}.get(fam.type, ("",))
        names |= {fam.name + s for s in suffixes}
    return names


#: Series from elsewhere that the alerts read on purpose.
EXTERNAL_SERIES = {"kube_pod_status_reason"}
_PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "by", "without", "rate", "increase", "histogram_quantile",
                 "and", "or", "unless", "on", "ignoring", "vector", "le", "humanizeDuration", "max_over_time",
                 "avg_over_time"}


def _series_in(expr: str) -> set[str]:
    expr = re.sub(r'\{[^}]*\}', "", expr)          # label matchers
    expr = re.sub(r'\[[^\]]*\]', "", expr)          # ranges
    expr = re.sub(r'\bby\s*\([^)]*\)', "", expr)    # grouping labels
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in _PROMQL_WORDS}


def test_alerts_read_series_the_code_exports() -> None:
    exported = _exported_series()
    rule = one(build("nvidia", monitoring=True), "PrometheusRule", "gpu-slice")
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"GpuSliceSignalStale", "GpuSliceSlicesUnhealthy", "GpuSlicePodAdmissionFailed",
            "GpuSliceAssignmentNotHonoured", "GpuSliceExtenderSlow"} <= alerts.keys()
    for name, expr in alerts.items():
        series = _series_in(expr)
        assert series, name
        assert series <= exported | EXTERNAL_SERIES, f"{name} reads {series - exported - EXTERNAL_SERIES}"


def test_dashboard_reads_series_the_code_exports() -> None:
    exported = _exported_series()
    objs = build("nvidia", monitoring=True)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-slice-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["gpu-slice.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        series = _series_in(expr)
        assert series and series <= exported, f"{expr}: {series - exported}"


def test_the_pod_dashboard_reads_per_pod_series_by_their_labels() -> None:
    """The pod view (README "Monitoring"): every query reads exported series, filters only on labels the
    per-pod series carry, and its variables list namespaces and pods from them."""
    from deviceplugin.pod_series import POD_LABELS

    exported = _exported_series()
    (cm,) = [o for o in build("nvidia", monitoring=True)
             if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-slice-pods-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["gpu-slice-pods.json"])
    assert dash["uid"] == "gpu-slice-pods" and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert any("gpu_slice_pod_gpu_activity_ratio" in e for e in exprs)
    assert any("gpu_slice_cluster_stranded_slices" in e for e in exprs)
    assert any("gpu_slice_cluster_pending_pods" in e for e in exprs)
    for expr in exprs:
        series = _series_in(expr)
        assert series and series <= exported, f"{expr}: {series - exported}"
        for matchers in re.findall(r"gpu_slice_pod_\w+\{([^}]*)\}", expr):
            used = set(re.findall(r"(\w+)\s*=~?", matchers))
            assert used <= set(POD_LABELS), (expr, used)
        for grouping in re.findall(r"by \(([^)]*)\) \((?:max_over_time\()?gpu_slice_pod_", expr):
            assert {g.strip() for g in grouping.split(",")} <= set(POD_LABELS), expr
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["namespace"]["definition"] == "label_values(gpu_slice_pod_slices, namespace)"
    assert variables["pod"]["definition"].startswith("label_values(gpu_slice_pod_slices{")


# ---- what users copy --------------------------------------------------------------------------------

def test_examples_opt_in_and_are_sized_by_memory() -> None:
    objs = build("nvidia")
    pc = one(objs, "PriorityClass", "gpu-slice-serving")
    assert pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    templates = {(f, o["kind"]): o["spec"]["template"] for f, o in examples() if o["kind"] in ("Deployment", "Job")}
    assert set(templates) == {("vllm.yaml", "Deployment"), ("tgi.yaml", "Deployment"),
                              ("mig-only.yaml", "Deployment"), ("batch-spot.yaml", "Job"),
                              ("autoscaling/hpa-vllm.yaml", "Deployment")}
    for (f, _), tpl in templates.items():
        spec = tpl["spec"]
        assert spec["schedulerName"] == PROFILE, f
        assert spec["priorityClassName"] == pc["metadata"]["name"], f
        req = parse_request({"metadata": tpl["metadata"], "spec": spec})
        assert req is not None and req.memory_mib is not None, f
        for c in spec["containers"]:
            assert not any(m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts", [])), \
                f"{f}: /dev/shm is the MPS daemon's, mounted by the device plugin"
    mig = parse_request({"metadata": templates[("mig-only.yaml", "Deployment")]["metadata"],
                         "spec": templates[("mig-only.yaml", "Deployment")]["spec"]})
    assert mig is not None and mig.isolation == "mig"
    job = templates[("batch-spot.yaml", "Job")]["spec"]
    assert {"karpenter.sh/capacity-type", "cloud.google.com/gke-spot"} <= {t["key"] for t in job["tolerations"]}
    kinds = {(f, o["kind"]) for f, o in examples()}
    for f in ("vllm.yaml", "tgi.yaml", "autoscaling/hpa-vllm.yaml"):
        assert {(f, "Service"), (f, "HorizontalPodAutoscaler")} <= kinds


def test_image_and_makefile() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    version = project["project"]["version"]
    docker = (REPO / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", docker, re.M)
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", docker, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1)), \
        "a pinned slim base"
    assert froms and all("${PYTHON_IMAGE}" in f for f in froms)
    users = re.findall(r"^USER\s+(\S+)", docker, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image runs as non-root"
    assert re.search(r'^ENTRYPOINT \["gpu-slice"\]$', docker, re.M)
    for pkg in ("gpuslice", "gpuslice_cli", "simulator", "deviceplugin", "extender"):
        assert f"COPY {pkg} {pkg}" in docker, pkg
    # Every gpu-slice container runs this version and starts the right subcommand.
    objs = build("nvidia")
    images = {c["image"] for o in objs if o["kind"] in ("Deployment", "DaemonSet")
              for c in o["spec"]["template"]["spec"]["containers"] + o["spec"]["template"]["spec"].get(
                  "initContainers", []) if "gpu-slice" in c["image"]}
    assert images == {f"gpu-slice:{version}"}
    make = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", make, re.M))
    assert {"install", "test", "lint", "image", "manifests"} <= targets


def test_readme_install_section() -> None:
    readme = (REPO / "README.md").read_text()
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    for overlay in OVERLAYS:
        assert f"kubectl apply -k manifests/overlays/{overlay}" in install
        assert (MANIFESTS / "overlays" / overlay / "kustomization.yaml").is_file()
    for example in re.findall(r"manifests/examples/([\w./-]+\.yaml)", install):
        assert (EXAMPLES / example).is_file(), example
    versions = readme.split("\n## Supported versions\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| Kubernetes \| (\S+) to (\S+) \|", versions, re.M)
    assert rows == [(OLDEST, NEWEST)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scheduler_image_follows_the_clusters_version_through_one_knob(overlay: str) -> None:
    """Shipped at the version CI runs (the kube-scheduler in ../shared/k8s is v1.36.2); an ``images``
    entry over the overlay moves it to an older minor, and nothing else changes."""
    from tests.manifests.built import with_scheduler_tag

    def image(objs: list[dict[str, Any]]) -> str:
        dep = one(objs, "Deployment", "gpu-slice-scheduler")
        (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kube-scheduler"]
        return str(c["image"])

    shipped = build(overlay)
    assert image(shipped) == "registry.k8s.io/kube-scheduler:v1.36.2"
    moved = [dict(o) for o in with_scheduler_tag(overlay, "v1.31.4")]
    assert image(moved) == "registry.k8s.io/kube-scheduler:v1.31.4"
    assert len(moved) == len(shipped)
    base = (MANIFESTS / "base" / "kustomization.yaml").read_text()
    assert "registry.k8s.io/kube-scheduler" in base and "1.30-1.36" in base
