"""reorder_weights with a test-only layout: bytes rewritten and tagged, logits unchanged because
every reader unpacks by the tag; unknown tags are refused by name."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mgx.formats import ir, layouts
from mgx.passes import PassContext, PassError
from mgx.runtime.errors import UnsupportedModelError
from mgx.runtime.model_runner import ModelRunner

from _pass_testing import after, logits
from _tiny_graph import build_tiny_graph


def _reverse(arrays: dict[str, np.ndarray], params: dict) -> dict[str, np.ndarray]:
    return {role: np.ascontiguousarray(a[..., ::-1]) for role, a in arrays.items()}


def _lossy(arrays: dict[str, np.ndarray], params: dict) -> dict[str, np.ndarray]:
    return {role: np.zeros_like(a) for role, a in arrays.items()}


@pytest.fixture
def test_layouts() -> Iterator[None]:
    """Layouts for target "test" (columns reversed, shape kept) and "broken" (unpack loses the data)."""
    added = [
        layouts.register_layout(layouts.Layout("test_reversed", ("none", "w8a16", "int4"), ("test",), _reverse,
                                               _reverse, "every array's last axis reversed")),
        layouts.register_layout(layouts.Layout("test_broken", ("none",), ("broken",), _reverse, _lossy)),
    ]
    yield
    for layout in added:
        del layouts.LAYOUTS[layout.name]


@pytest.mark.parametrize("quantize", [None, "quantize_w8a16", ("quantize_int4", {"group_size": 32})],
                         ids=["dense", "w8a16", "int4"])
def test_reorder_packs_tags_and_runs_the_same(test_layouts: None, quantize) -> None:  # noqa: ANN001
    graph, _ = build_tiny_graph()
    base, _ = after(graph, *([quantize] if quantize else []))
    packed, (res,) = after(base, "reorder_weights", context=PassContext(target="test"))
    moved = [op for op in packed.ops if op.kind in ("linear", "lm_head")]
    assert res.stats["moved"] == {"test_reversed": len(moved)}
    for op in moved:
        for role, name in op.weights.items():
            if role == "bias":
                continue
            t, before = packed.tensors[name], base.tensors[name]
            assert t.layout == "test_reversed" and t.scheme == before.scheme
            np.testing.assert_array_equal(t.data, before.data[..., ::-1])
    embedding = next(op for op in packed.ops if op.kind == "embedding")
    assert packed.tensors[embedding.weights["weight"]].layout == "row_major"  # skip.embedding by default
    np.testing.assert_array_equal(logits(packed), logits(base))


def test_reorder_for_cpu_uses_what_the_registry_prefers() -> None:
    graph, _ = build_tiny_graph()
    packed, _ = after(graph, ("quantize_int4", {"group_size": 32}), "reorder_weights")
    for op in packed.ops:
        if op.kind in ("linear", "lm_head"):
            t = packed.tensors[op.weights["weight"]]
            assert t.layout == layouts.layout_for("cpu", t.scheme)


def test_reorder_checks_the_round_trip(test_layouts: None) -> None:
    graph, _ = build_tiny_graph()
    with pytest.raises(PassError, match="layout 'test_broken' does not unpack"):
        after(graph, "reorder_weights", context=PassContext(target="broken"))


def test_later_passes_refuse_reordered_weights(test_layouts: None) -> None:
    graph, _ = build_tiny_graph()
    packed, _ = after(graph, "reorder_weights", context=PassContext(target="test"))
    with pytest.raises(PassError, match="run reorder_weights last"):
        after(packed, "quantize_w8a16")


def test_backend_refuses_an_unknown_layout_by_name() -> None:
    graph, _ = build_tiny_graph()
    q, _ = after(graph, ("quantize_int4", {"group_size": 32}))
    name = "layers.0.mlp.up_proj.weight"
    t = q.tensors[name]
    q.tensors[name] = ir.Tensor(t.name, t.dtype, t.shape, t.data, t.scheme, t.scheme_params, "tiles_9x9")
    with pytest.raises(UnsupportedModelError, match=r"scheme 'int4', layout 'tiles_9x9'"):
        ModelRunner(q)
