"""Scenario 6: bad input at every door.

* At least 1,000 malformed or hostile requests (hypothesis: wrong types, missing fields, unknown nodes,
  random JSON, deep and huge bodies) to the leading extender's ``/filter``, ``/prioritize``, ``/bind``
  and ``/preempt``: each is answered 4xx, or 200 with an ``Error`` field, or (a well-formed request
  naming unknown nodes) 200 passing no node that does not exist and scoring each 0; never a 5xx or a
  dropped connection.
  After every 100 and at the end a good ``/filter`` is answered correctly.
* Hostile pod annotations: a tenant (a service account allowed to create pods, nothing more) cannot
  create a pod carrying a forged assignment or ``allocated`` stamp, nor patch one onto a pod: the
  shipped admission policy refuses it. A forged assignment written by the cluster admin (who bypasses
  nothing but RBAC) for another pod's UID is ignored by the counting rule: the pod is never admitted
  with those ids, and the audit stays clean.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.harness import (
    ALLOCATED,
    ASSIGNMENT,
    System,
    clean,
    cluster,
    counts_dict,
    http,
    slice_pod,
    wait_placed,
)

pytestmark = pytest.mark.timeout(400)

VERBS = ("filter", "prioritize", "bind", "preempt")
NODES = ["gpu-mig", "gpu-mps", "gpu-mix"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
names = st.text(min_size=0, max_size=40) | st.sampled_from(NODES) | st.just("x" * 300)


def _pod(slices: Any, annotations: Any = None) -> Any:
    return {"metadata": {"name": "hostile", "namespace": "e2e-nowhere", "uid": "00000000-0000-0000-0000-000000000000",
                         "annotations": annotations if annotations is not None else {}},
            "spec": {"schedulerName": "gpu-slice-scheduler",
                     "containers": [{"name": "c", "resources": {"limits": {"example.com/gpu-slice": slices}}}]}}


bodies = st.one_of(
    json_values,                                                              # random JSON of any shape
    st.fixed_dictionaries({"Pod": json_values, "NodeNames": json_values}),   # wrong types
    st.fixed_dictionaries({"Pod": st.builds(_pod, json_values, json_values),
                           "NodeNames": st.lists(names, max_size=8)}),      # unknown nodes, odd requests
    st.fixed_dictionaries({"NodeNames": st.lists(names, max_size=3)}),       # Pod missing
    st.fixed_dictionaries({"Pod": st.builds(_pod, st.integers(-10, 100))}),  # NodeNames missing
    st.fixed_dictionaries({"PodName": names, "PodNamespace": names, "PodUID": names, "Node": names}),  # bind
    st.fixed_dictionaries({"Pod": st.builds(_pod, st.integers(1, 7)),
                           "NodeNameToMetaVictims": st.dictionaries(names, json_values, max_size=3)}),
)


def _acceptable(verb: str, status: int, raw: bytes, sent: Any) -> str | None:
    """None when the answer is a proper refusal (or a correct answer); else what is wrong."""
    if 400 <= status < 500:
        return None
    if status != 200:
        return f"status {status}: {raw[:300]!r}"
    try:
        body = json.loads(raw)
    except ValueError:
        return f"200 with a body that is not JSON: {raw[:200]!r}"
    if isinstance(body, dict) and body.get("Error"):
        return None
    if verb == "filter" and isinstance(body, dict):
        passed = body.get("NodeNames") or []
        unknown = [n for n in passed if n not in NODES]
        return f"filter passed unknown nodes {unknown}" if unknown else None
    if verb == "prioritize" and isinstance(body, list):
        # kube-scheduler only adds scores for nodes that passed its filters, so 0 for a name it sent is
        # harmless; anything above 0 for a node that does not exist is a wrong answer.
        unknown = [e.get("Host") for e in body
                   if isinstance(e, dict) and e.get("Host") not in NODES and e.get("Score") != 0]
        return f"prioritize gave unknown nodes a score {unknown}" if unknown else None
    if verb == "bind":
        return "bind of a hostile pod answered without an Error"
    return None if verb == "preempt" else f"unexpected answer {raw[:200]!r}"


def _good_filter(url: str, probe: dict[str, Any]) -> None:
    """A well-formed /filter for ``probe``, a pod the API server holds (the extender holds nothing for a
    pod it cannot find), still answered after the hostile ones."""
    status, raw = http("POST", f"{url}/filter", json.dumps({"Pod": probe, "NodeNames": NODES}).encode(),
                       headers={"Content-Type": "application/json"})
    assert status == 200, (status, raw[:500])
    body = json.loads(raw)
    assert not body.get("Error") and body.get("NodeNames"), body


def test_hostile_extender_requests(system: System, record: dict[str, Any]) -> None:
    url = system.wait_leader().url
    # A real pending pod no scheduler picks up (another scheduler's name), for the good requests.
    body = slice_pod("probe", 1)
    body["spec"]["schedulerName"] = "e2e-nobody"
    probe = system.kube.create_pod(body)
    tried: dict[str, int] = {}
    wrong: list[str] = []

    @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(verb=st.sampled_from(VERBS), body=bodies)
    def one(verb: str, body: Any) -> None:
        raw_body = json.dumps(body).encode()
        status, raw = http("POST", f"{url}/{verb}", raw_body, headers={"Content-Type": "application/json"})
        n = sum(tried.values())
        tried[verb] = tried.get(verb, 0) + 1
        why = _acceptable(verb, status, raw, body)
        if why:
            wrong.append(f"{verb} {raw_body[:200]!r}: {why}")
        if n % 100 == 99:
            _good_filter(url, probe)

    one()
    # Deep, huge and non-JSON bodies.
    extra = {"deep": b"[" * 200_000 + b"]" * 200_000, "huge": b'{"Pod": "' + b"x" * (17 * 1024 * 1024) + b'"}',
             "not json": b"\xff\xfe{", "empty": b""}
    for label, raw_body in extra.items():
        for verb in VERBS:
            status, raw = http("POST", f"{url}/{verb}", raw_body, timeout=60,
                               headers={"Content-Type": "application/json"})
            tried[f"{verb} ({label})"] = 1
            if not 400 <= status < 500 and not (status == 200 and b'"Error"' in raw):
                wrong.append(f"{verb} {label}: status {status} {raw[:200]!r}")
    _good_filter(url, probe)
    record.update(requests=sum(tried.values()), by_verb=tried, wrong=len(wrong))
    assert sum(tried.values()) >= 1000
    assert not wrong, wrong[:20]


def test_forged_annotations_refused_or_ignored(system: System, record: dict[str, Any]) -> None:
    kc = system.work / "tenant.kubeconfig"
    system.kubectl("create", "serviceaccount", "e2e-tenant", "-n", "default", check=False)
    system.kubectl("create", "role", "e2e-tenant", "-n", "default", "--verb=create,get,patch,update,delete",
                   "--resource=pods", check=False)
    system.kubectl("create", "rolebinding", "e2e-tenant", "-n", "default", "--role=e2e-tenant",
                   "--serviceaccount=default:e2e-tenant", check=False)
    cluster("sa-kubeconfig", str(system.work), "default/e2e-tenant", str(kc))

    def tenant(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", "--kubeconfig", str(kc), *args], input=stdin, capture_output=True,
                              text=True, timeout=60, check=False)

    forged = {"v": 1, "podUID": "x", "node": "gpu-mix", "gpus": ["GPU-forged"], "instance": None,
              "sliceIds": ["GPU-forged::0"], "policy": "fragmentation", "scores": {}, "time": "2026-01-01T00:00:00Z"}
    refused = 0
    for key in (ASSIGNMENT, ALLOCATED, "example.com/gpu-slice.cordon"):
        body = slice_pod(f"forged-{key.rsplit('.', 1)[-1]}", 1, annotations={key: json.dumps(forged)})
        done = tenant("create", "-f", "-", stdin=json.dumps(body))
        assert done.returncode != 0, f"the tenant created a pod with {key}: {done.stdout}"
        refused += 1
    # A plain pod the tenant may create; patching the assignment onto it is refused too.
    ok = tenant("create", "-f", "-", stdin=json.dumps(slice_pod("tenant-plain", 1)))
    assert ok.returncode == 0, ok.stderr
    done = tenant("annotate", "pod", "tenant-plain", f"{ASSIGNMENT}={json.dumps(forged)}")
    assert done.returncode != 0, "the tenant patched an assignment onto its pod"
    refused += 1
    placed = wait_placed(system, ["tenant-plain"])["tenant-plain"]
    assert json.loads(placed["metadata"]["annotations"][ASSIGNMENT])["podUID"] == placed["metadata"]["uid"]
    counts = system.settle_and_audit()
    record.update(forged_writes_refused=refused, counts=counts_dict(counts))
    assert not counts.bad(), counts.problems
    clean(system)
