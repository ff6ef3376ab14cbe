"""``iter_list_items`` reads a List one item at a time and yields exactly what ``parse_list_text`` does."""

from __future__ import annotations

import io
import json

import pytest

from gpuslice.errors import GpuSliceError
from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.kubelist import dump_list, iter_list_items, parse_list_text

CASES = [
    "apiVersion: v1\nkind: List\nitems:\n- kind: Pod\n  metadata: {name: a, annotations: {x: '1'}}\n"
    "  spec: {n: 3, f: 1.5, b: true, z: null}\n- kind: Node\n  metadata: {name: n1}\n",
    "items:\n- metadata: {name: a}\nkind: PodList\n",               # the List's kind after its items
    "kind: Pod\nmetadata: {name: solo}\n---\nkind: Node\nmetadata: {name: n}\n",
    json.dumps({"kind": "List", "items": [{"kind": "Pod", "metadata": {"name": "j", "t": "2025-01-01T00:00:00Z"}}]}),
    "kind: NodeList\nitems:\n- &a {metadata: {name: x}}\n- *a\n",   # anchors and aliases
    "kind: List\nitems:\n- kind: List\n  items:\n  - kind: Pod\n    metadata: {name: nested}\n",
    "",
    "when: 2025-01-01T00:00:00Z\nkind: Pod\n",
]
BAD = ["kind: List\nitems: 3\n", "kind: List\nitems:\n- 3\n", "- a\n- b\n", "kind: List\nitems: [\n"]


@pytest.mark.parametrize("text", CASES)
def test_same_items_as_the_whole_parse(text: str) -> None:
    assert list(iter_list_items(io.StringIO(text))) == parse_list_text(text)


@pytest.mark.parametrize("text", BAD)
def test_same_refusals_as_the_whole_parse(text: str) -> None:
    with pytest.raises(GpuSliceError) as whole:
        parse_list_text(text)
    with pytest.raises(GpuSliceError) as streamed:
        list(iter_list_items(io.StringIO(text)))
    assert str(streamed.value).split(":")[0] == str(whole.value).split(":")[0]


def test_a_fake_cluster_file_streams_to_the_same_objects() -> None:
    text = dump_list(generate(FakeClusterSpec(nodes=20, mode="mixed", pods_per_node=5, seed=3)).document)
    streamed = iter_list_items(io.StringIO(text))
    assert next(streamed) == parse_list_text(text)[0]  # items come before the whole file is read
    assert [next(streamed), *streamed] == parse_list_text(text)[1:]
