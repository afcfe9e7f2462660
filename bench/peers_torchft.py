"""torchft's DiLoCo and Streaming DiLoCo as rows of ``bench/peers.py``, in its world of 2: each rank one replica
group of one rank under a lighthouse that rank 0 serves in its process, as ``bench/wan_worker.py`` runs it.

torchft's DiLoCo as its docs run it: a ``Manager`` per group over torchft's ``ProcessGroupGloo`` with a
synchronous quorum (DiLoCo's requirement), the user's eager loop, and the inner optimizer's post-step hook that,
every ``sync_every`` steps, takes the pseudo-gradient, all-reduces it tensor by tensor (its default, no buckets)
and steps the outer optimizer (the paper's Nesterov SGD, ours by default too) from the saved global weights.
Streaming (``fragments`` > 1): the same class over a list of model fragments, one outer optimizer each (as
torchtitan passes them), one fragment syncing every ``sync_every / fragments`` steps, its all-reduce started
``delay`` steps before it is waited for.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from bench.harness.launch import free_port
from passes.partitions import module_fragments

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}  # the DiLoCo paper's outer SGD, the mode's default
TIMEOUT = timedelta(seconds=120)
_GROUPS = itertools.count()  # every Manager's replica group a name of its own


class TorchftDiLoCo:
    """A lighthouse (on rank 0), this rank's ``Manager`` and torchft's ``DiLoCo`` over ``model``, for as long as one
    row is measured; :meth:`close` ends all three."""

    def __init__(
        self, model: nn.Module, inner: torch.optim.Optimizer, sync_every: int, fragments: int = 1, delay: int = 0
    ) -> None:
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo

        port = [free_port() if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        world = dist.get_world_size()
        self.server = LighthouseServer(bind=f"[::]:{port[0]}", min_replicas=world) if dist.get_rank() == 0 else None
        dist.barrier()  # the lighthouse listens before any Manager asks it for a quorum
        self.store, self.manager = torchft_manager("127.0.0.1", f"http://127.0.0.1:{port[0]}", f"peers{next(_GROUPS)}-")
        parts = _fragments(model, fragments)
        self.model, self.inner, self.outer = model, inner, [torch.optim.SGD(p.parameters(), **OUTER) for p in parts]
        self.diloco = DiLoCo(
            self.manager, parts, inner, self.outer, sync_every=sync_every, fragment_sync_delay=delay
        ).__enter__()

    def kept(self) -> list[torch.Tensor]:
        """What torchft holds besides the model and the inner optimizer: the outer optimizer's momentum and what each
        fragment keeps (the global weights, its pseudo-gradients)."""
        extra = [v for outer in self.outer for s in outer.state.values() for v in s.values() if torch.is_tensor(v)]
        for fragment in self.diloco._fragments:
            extra += _tensors(getattr(fragment, "original_parameters", {}).values())
            extra += _tensors(getattr(fragment, "_grads", {}).values())
        return extra

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()  # neither rank's Manager outlives the lighthouse
        if self.server is not None:
            self.server.shutdown()


def torchft_manager(address: str, lighthouse: str, name: str):
    """This rank's torchft ``Manager`` as a replica group of one rank named ``name`` plus this rank's number, over
    torchft's ``ProcessGroupGloo`` with a synchronous quorum (DiLoCo's requirement), every group starting from the
    same weights; and the store it rendezvouses on (kept alive with it)."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=dist.get_world_size(),
        use_async_quorum=False,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr=address,
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"{name}{dist.get_rank()}",
        hostname=socket.gethostname(),
        init_sync=False,
    )
    return store, manager


def _fragments(model: nn.Module, fragments: int) -> list[nn.Module]:
    """``model`` whole (one fragment), or cut into ``fragments`` runs of whole modules balanced by size, the cut
    ``streaming_diloco`` makes (``passes/partitions.py``), each a ``ParameterList`` of its parameters."""
    if fragments == 1:
        return [model]
    named = list(model.named_parameters())
    part = module_fragments([(name, p.numel()) for name, p in named], fragments)
    return [nn.ParameterList([p for name, p in named if part[name] == f]) for f in range(fragments)]


def _tensors(values: Iterable) -> list[torch.Tensor]:
    return [v for v in values if torch.is_tensor(v)]
