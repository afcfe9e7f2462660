"""``repair_order``: a stable topological repair of an fx graph (networkx's lexicographical sort)."""

from __future__ import annotations

import operator

import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st

from transpiler.graph.edit import repair_order


@given(n=st.integers(3, 12), moved=st.data())
def test_a_node_moved_before_its_input_goes_back_and_the_rest_keep_their_order(n, moved):
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [x]
    for i in range(n):  # a chain with side branches: node i reads node i-1 and, sometimes, x
        nodes.append(graph.call_function(operator.add, (nodes[-1], x if i % 3 else 1)))
    graph.output(nodes[-1])
    i = moved.draw(st.integers(2, n))  # put node i right after the placeholder, ahead of its input
    x.append(nodes[i])
    before = [m for m in graph.nodes if m is not nodes[i]]
    assert repair_order(graph) is True
    graph.lint()  # every node after its inputs
    assert [m for m in graph.nodes if m is not nodes[i]] == before  # nothing else moved
    assert repair_order(graph) is False
