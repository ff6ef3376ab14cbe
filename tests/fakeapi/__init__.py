"""An in-process fake Kubernetes API server shared by all test packages (DESIGN.md section 8).

Use it through the real client, never by mocking the client::

    # conftest.py of another test package
    from tests.fakeapi.fixtures import fake_api  # noqa: F401

    def test_x(fake_api):
        core = kubernetes.client.CoreV1Api(fake_api.client())
        fake_api.store.put_node({"metadata": {"name": "n1"}})     # arrange state directly
        fake_api.fail_next("create", "*/pods/*/binding", code=500)  # inject faults

Semantics kept from the real API server, because code that passes here must work on a cluster:
Status objects for errors; one global, monotonic resourceVersion; the main resource ignores ``status``
and ``/status`` ignores ``spec`` (Pods, Nodes); pod specs are immutable except images and a few fields,
so ``spec.nodeName`` is set only by ``pods/binding``; pod limits default the requests and extended
resources need requests == limits; no-op writes do not bump the version; a Binding answers a
``Status`` (201), which the typed client cannot parse into ``V1Binding``: call
``create_namespaced_pod_binding(..., _preload_content=False)``; watches from "" or "0" start with
synthetic ADDED events; selector-filtered watches turn MODIFIED into ADDED/DELETED when an object
enters/leaves the selection.

Not supported: other resources, protobuf, server-side apply (415), dryRun (400), finalizers, namespace
existence checks, list snapshots at an older resourceVersion (lists are always current; later
``continue`` pages are cut from the current state), field selectors beyond the real per-resource
field labels, pod QoS class, managedFields, authentication.
"""

from .server import FakeApiServer, Fault, Request
from .store import RESOURCES, ApiError, Selector, Store

__all__ = ["RESOURCES", "ApiError", "FakeApiServer", "Fault", "Request", "Selector", "Store"]
