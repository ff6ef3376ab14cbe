"""Reading a ``v1 List`` of Nodes and Pods (``kubectl get nodes,pods -o yaml``) into the core's model.

The simulator and the tests start from such files (``gpu-slice fake-cluster`` writes them, an
operator can dump a real cluster); reading them goes through the same codecs and the same counting
rule as the services, so a file that loads here is one the extender would accept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import IO, Any

import yaml

from gpuslice import annotations as ann
from gpuslice.counting import Holdings, PodProblem, apply_holdings, held_by_node
from gpuslice.errors import AnnotationError, GpuSliceError
from gpuslice.model import Gpu, NodeInventory

LIST_KINDS = {"List": None, "NodeList": "Node", "PodList": "Pod"}

# libyaml when present: 4-5x faster on cluster dumps, same documents (checked by the tests).
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@dataclass(frozen=True, slots=True)
class NodeProblem:
    """A node whose inventory could not be read; it is left out of the cluster."""

    node: str
    reason: str

    def __str__(self) -> str:
        return f"node {self.node}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Inventories with ``used`` set by the counting rule, the pods, and everything that was wrong."""

    inventories: Mapping[str, NodeInventory]
    nodes: Mapping[str, Mapping[str, Any]]
    pods: tuple[Mapping[str, Any], ...]
    holdings: Mapping[str, Holdings]
    node_problems: tuple[NodeProblem, ...]
    pod_problems: tuple[PodProblem, ...]

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(str(p) for p in (*self.node_problems, *self.pod_problems))


def parse_list_text(text: str) -> list[Mapping[str, Any]]:
    """The items of a YAML or JSON ``List``/``NodeList``/``PodList`` (or a stream of objects)."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as err:
        raise GpuSliceError(f"not valid YAML: {err}") from None
    items: list[Mapping[str, Any]] = []
    for doc in docs:
        items.extend(list_items(doc))
    return items


def iter_list_items(stream: IO[str] | str) -> Iterator[Mapping[str, Any]]:
    """The items of :func:`parse_list_text`, one at a time, from a text stream.

    A ``List`` of 50,000 pods parsed whole is gigabytes of Python objects held at once; this reads
    the YAML (or JSON) as libyaml events and builds one item at a time, so a caller that projects
    each item as it comes never holds more than one. Same documents, same errors as
    :func:`parse_list_text`."""
    loader: Any = _Loader(stream)
    try:
        loader.get_event()  # StreamStart
        while not loader.check_event(yaml.StreamEndEvent):
            loader.get_event()  # DocumentStart
            if loader.check_event(yaml.MappingStartEvent):
                yield from _document_items(loader)
            else:
                doc = _build(loader, {})
                if doc is not None:
                    yield from list_items(doc)
            loader.get_event()  # DocumentEnd
    except yaml.YAMLError as err:
        raise GpuSliceError(f"not valid YAML: {err}") from None
    finally:
        loader.dispose()


def _document_items(loader: Any) -> Iterator[Mapping[str, Any]]:
    """One document that is a mapping: a List's items as they are read, else the object itself."""
    anchors: dict[str, Any] = {}
    loader.get_event()  # MappingStart
    head: dict[Any, Any] = {}
    waiting: list[Mapping[str, Any]] = []  # items read before the List's own kind
    streamed = False
    while not loader.check_event(yaml.MappingEndEvent):
        key = _build(loader, anchors)
        if key == "items" and loader.check_event(yaml.SequenceStartEvent) and head.get("kind", "List") in LIST_KINDS:
            streamed = True
            loader.get_event()
            n = 0
            while not loader.check_event(yaml.SequenceEndEvent):
                item = _build(loader, anchors)
                if not isinstance(item, Mapping):
                    raise GpuSliceError(f"{head.get('kind', 'List')}.items[{n}] must be an object")
                n += 1
                if "kind" in item:
                    yield from list_items(item)
                elif "kind" in head:
                    yield from list_items({"kind": head["kind"], "items": [item]})
                else:
                    waiting.append(item)
            loader.get_event()
        else:
            head[key] = _build(loader, anchors)
    loader.get_event()  # MappingEnd
    if not streamed:
        yield from list_items(head)
        return
    if head.get("kind", "List") not in LIST_KINDS:
        raise GpuSliceError(f"a {head.get('kind')} with items is not a List")
    if waiting:
        yield from list_items({"kind": head.get("kind", "List"), "items": waiting})


def _build(loader: Any, anchors: dict[str, Any]) -> Any:
    """One node's Python value from the events, as the safe loader would construct it."""
    event = loader.get_event()
    if isinstance(event, yaml.AliasEvent):
        if event.anchor not in anchors:
            raise GpuSliceError(f"YAML alias *{event.anchor} names no anchor")
        return anchors[event.anchor]
    if isinstance(event, yaml.ScalarEvent):
        tag = event.tag
        if tag is None or tag == "!":
            tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
        node = yaml.ScalarNode(tag, event.value, None, None, event.style)
        make = loader.yaml_constructors.get(tag, loader.yaml_constructors.get(None))
        value = make(loader, node)
    elif isinstance(event, yaml.SequenceStartEvent):
        value = []
        while not loader.check_event(yaml.SequenceEndEvent):
            value.append(_build(loader, anchors))
        loader.get_event()
    elif isinstance(event, yaml.MappingStartEvent):
        value = {}
        while not loader.check_event(yaml.MappingEndEvent):
            key = _build(loader, anchors)
            try:
                value[key] = _build(loader, anchors)
            except TypeError:
                raise GpuSliceError(f"YAML mapping key {key!r} is not hashable") from None
        loader.get_event()
    else:
        raise GpuSliceError(f"unexpected YAML event {type(event).__name__}")
    if event.anchor is not None:
        anchors[event.anchor] = value
    return value


def list_items(doc: object) -> list[Mapping[str, Any]]:
    """Flatten one parsed document into objects that each carry ``kind``."""
    if not isinstance(doc, Mapping):
        raise GpuSliceError(f"expected a Kubernetes object or List, got {type(doc).__name__}")
    kind = doc.get("kind")
    if kind not in LIST_KINDS:
        return [doc]
    raw = doc.get("items") or []
    if not isinstance(raw, list):
        raise GpuSliceError(f"{kind}.items must be a list")
    implied = LIST_KINDS[kind]
    out: list[Mapping[str, Any]] = []
    for n, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise GpuSliceError(f"{kind}.items[{n}] must be an object")
        if "kind" not in item and implied is not None:
            item = {**item, "kind": implied}
        out.extend(list_items(item))
    return out


def node_name(node: Mapping[str, Any]) -> str:
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def node_inventory(node: Mapping[str, Any]) -> NodeInventory | None:
    """The node's GPUs from its inventory annotation, or ``None`` when it has none (not a slice node).

    A GPU listed in the cordon annotation counts as cordoned even before the plugin has echoed it
    in the inventory, so an operator's cordon takes effect at the next scheduling decision.
    """
    annotations = ann.pod_annotations(node)
    raw = annotations.get(ann.INVENTORY_KEY)
    if raw is None:
        return None
    return with_cordon(node_name(node), ann.decode_inventory(raw), annotations.get(ann.CORDON_KEY))


def with_cordon(name: str, gpus: tuple[Gpu, ...], raw_cordon: object) -> NodeInventory:
    """The inventory of decoded ``gpus`` with the node's cordon annotation applied (the one cordon rule)."""
    cordon = ann.parse_cordon(raw_cordon)
    unknown = cordon - {g.uuid for g in gpus}
    if unknown:
        raise AnnotationError(f"{ann.CORDON_KEY} names GPUs not on this node: {', '.join(sorted(unknown))}")
    if cordon:
        gpus = tuple(replace(g, cordoned=True) if g.uuid in cordon else g for g in gpus)
    return NodeInventory(name, gpus)


def load_cluster(items: Iterable[Mapping[str, Any]], *, now: datetime,
                 reservation_ttl: timedelta = timedelta(seconds=60)) -> ClusterView:
    """Inventories and pods from Kubernetes objects, bookkeeping by the counting rule.

    Bad nodes and pods are reported, not raised, exactly as the services treat them.
    """
    nodes: dict[str, Mapping[str, Any]] = {}
    pods: list[Mapping[str, Any]] = []
    inventories: dict[str, NodeInventory] = {}
    node_problems: list[NodeProblem] = []
    for item in items:
        kind = item.get("kind")
        if kind == "Node":
            name = node_name(item)
            if not name:
                node_problems.append(NodeProblem("?", "has no metadata.name"))
                continue
            nodes[name] = item
            try:
                inv = node_inventory(item)
            except GpuSliceError as err:
                node_problems.append(NodeProblem(name, str(err)))
                continue
            if inv is not None:
                inventories[name] = inv
        elif kind == "Pod":
            pods.append(item)
    by_node, pod_problems = held_by_node(pods, now=now, reservation_ttl=reservation_ttl)
    problems = list(pod_problems)
    holdings: dict[str, Holdings] = {}
    for name, inv in inventories.items():
        held = by_node.get(name, Holdings(name, {}, ()))
        inventories[name], settled = apply_holdings(inv, held)
        problems.extend(settled.problems[len(held.problems):])
        holdings[name] = settled
    for name, held in by_node.items():
        if name not in inventories and held.held:
            for h in held.held.values():
                problems.append(PodProblem(h.pod, h.pod_uid, f"holds slices on {name}, which has no readable "
                                                             "inventory"))
    return ClusterView(inventories, nodes, tuple(pods), holdings, tuple(node_problems), tuple(problems))


def load_cluster_text(text: str, *, now: datetime,
                      reservation_ttl: timedelta = timedelta(seconds=60)) -> ClusterView:
    """``load_cluster`` over YAML or JSON text."""
    return load_cluster(parse_list_text(text), now=now, reservation_ttl=reservation_ttl)


def dump_list(document: Mapping[str, Any]) -> str:
    """YAML as kubectl writes it (sorted keys, block style), deterministic for a given document."""
    return yaml.dump(dict(document), Dumper=_Dumper, sort_keys=True, default_flow_style=False,
                     allow_unicode=False, width=1 << 16)
