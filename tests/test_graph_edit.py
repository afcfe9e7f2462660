"""``repair_order``: a stable topological repair of an fx graph (networkx's lexicographical sort)."""

from __future__ import annotations

import operator

import pytest
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st

from transpiler.graph.edit import repair_order

pytestmark = pytest.mark.quick  # the quick tier: static


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


def test_pass_added_state_is_traced_where_the_runtime_puts_it():
    """``add_state``: the fake value of new state sits where ``ExtraInit.make`` puts the real one, the parameters'
    device (here ``meta``, standing for a GPU), or the CPU for a host copy, whatever device ``like`` had. On the GPU
    a loss scale traced on the CPU was refused by the capture as a CPU value feeding the device."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from passes.gradient_flow import add_state, fake_tensor
    from transpiler.graph.ports import ExtraInit, Port
    from transpiler.graph.program import StepProgram

    graph = fx.Graph()
    weight = graph.placeholder("p_w")
    with FakeTensorMode():
        weight.meta.update(val=torch.empty(4, device="meta"), port=Port("param", "w"))
    graph.output(())
    program = StepProgram(fx.GraphModule(torch.nn.Module(), graph), [Port("param", "w")], [])
    scale = add_state(program, "scale", fake_tensor(program, torch.float32), ExtraInit.scalar(1.0, torch.float32))
    host = add_state(program, "host", weight.meta["val"], ExtraInit.host_copy_of("w"))
    assert fake_tensor(program, torch.float32).device.type == "cpu"
    assert scale.meta["val"].device.type == "meta" and scale.meta["val"].dim() == 0
    assert host.meta["val"].device.type == "cpu" and host.meta["val"].shape == (4,)
