"""The quorum's peer: the digits example's job as torchft's own users write it, ``Manager`` + its DDP wrapper.

One replica group per torchrun job (``bench/fault_tolerance.py`` starts them beside a lighthouse, as it starts the
example's ``--fault-tolerance`` groups): torchft's ``Manager`` over its ``ProcessGroupGloo``, the model in
``torchft.ddp.DistributedDataParallel`` (DDP whose buckets all-reduce through the manager) and Adam in
``torchft.optim.OptimizerWrapper`` (``zero_grad`` starts the quorum, ``step`` votes and updates only if the step
commits), as torchft's ``train_ddp.py`` does. The same MLP, data, batch and learning rate as
``examples/train_digits.py``; each step writes one JSON line in the example's ``--log-samples`` format (the fields
the bench reads), so the bench counts committed steps the same way for both.

    torchrun --nproc-per-node 1 bench/torchft_ddp_worker.py --log-samples DIR --min-replicas 2 [--sync-quorum]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from examples.train_digits import DEFAULT_LR, load_data, mlp
from transpiler import init_distributed
from transpiler.runtime.join_world import round_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log-samples", required=True, help="directory for the per-step JSON lines")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=32, help="samples per group and step")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--hidden", type=int, default=128, help="the MLP's first hidden width (the example's)")
    parser.add_argument("--steps", type=int, default=None, help="stop at this committed step (default: never)")
    parser.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False (torchft's default: True)")
    args = parser.parse_args()
    from torchft import ddp, optim
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=args.timeout)
    init_distributed("gloo", args.timeout)
    torch.manual_seed(0)
    x, _, y, _ = load_data(seed=0)
    model = mlp(args.hidden)
    inner = torch.optim.Adam(model.parameters(), lr=DEFAULT_LR["adam"])
    store_addr, store_port, _server = round_store(timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=args.min_replicas,
        use_async_quorum=not args.sync_quorum,
        timeout=timeout,
        connect_timeout=timeout,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        store_addr=store_addr,
        store_port=store_port,
        replica_id=os.environ["REPLICA_GROUP_ID"],
    )
    wrapped, optimizer = ddp.DistributedDataParallel(manager, model), optim.OptimizerWrapper(manager, inner)
    loss_fn = torch.nn.CrossEntropyLoss()
    log = _log(args.log_samples)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    attempt = time.time()
    while args.steps is None or manager.current_step() < args.steps:  # a group that heals joins at its peers' step
        optimizer.zero_grad()  # the wrapper starts the quorum
        start = manager.current_step() * args.global_batch % (len(x) - args.global_batch)
        idx = order[start : start + args.global_batch]
        loss = loss_fn(wrapped(x[idx]), y[idx])
        loss.backward()
        committed = manager.should_commit()  # the wrapper's step, inlined to log whether the step committed
        if committed:
            inner.step()
        record = {"attempt": attempt, "world": 1, "rank": 0, "pid": os.getpid(), "step": manager.current_step()}
        record.update(time=time.time(), committed=committed, ids=idx.tolist(), loss=loss.item())
        log.write(json.dumps(record) + "\n")
        log.flush()
    manager.shutdown(wait=False)


def _log(directory: str):
    """This group's sample log, named as the example names a group's (``g0-rank0.jsonl``)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    return open(Path(directory) / f"{os.environ['REPLICA_GROUP_ID']}-rank0.jsonl", "a")  # noqa: SIM115


if __name__ == "__main__":
    main()
