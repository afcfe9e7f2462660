"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge, made and deleted by
the test that uses them. Each host has one interface with an address that exists only inside these namespaces,
and runs its own ``torchrun``; ``GLOO_SOCKET_IFNAME`` makes gloo use that interface, so the ranks of two hosts
talk over the veth links, and taking a link down partitions a host silently (no reset, no error: packets stop).

A host's link can be given a rate (:meth:`Host.shape`): a token bucket (``tc``'s ``tbf``) on both ends of its veth
pair, so that what it sends and what it receives are limited alike, as a site's uplink is. Only the rate is shaped:
this kernel has no ``netem``, so no latency or loss is added, and a round trip costs what it costs on a veth (tens of
microseconds) plus the time queued behind this host's own traffic in the bucket (at most ``QUEUE_MS``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import zygote

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUBNET = "10.231.0"  # inside the namespaces only
QUEUE_MS = 50  # tbf's latency: the most a packet waits in a shaped link's queue before it is dropped


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"tpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _json(*args: str) -> list[dict]:
    return json.loads(subprocess.run(["ip", "-j", *args], check=True, capture_output=True, text=True).stdout)


@dataclass
class Host:
    name: str  # the namespace
    interface: str
    address: str
    switch: str  # the bridge's namespace
    agents: list[subprocess.Popen] = field(default_factory=list)
    named: bool = False  # its processes see its own host name, which every host resolves to its address

    def run(self, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``command`` inside this host, in its own process group (so that the whole host can be killed),
        with gloo on this host's interface; on a ``named`` host under a host name of its own (a UTS namespace:
        torchft advertises ``socket.gethostname()``, which the namespaces otherwise share)."""
        env = {**env, "GLOO_SOCKET_IFNAME": self.interface}
        if self.named:
            command = ["unshare", "--uts", "sh", "-c", f'hostname {self.name} && exec "$@"', "sh", *command]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.name, *command],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
            )
        self.agents.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every process in this host's namespace (agents and their workers, which torchrun starts in
        sessions of their own): a host that is lost."""
        listed = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
        for pid in [int(p) for p in listed.split()] + [proc.pid for proc in self.agents]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.agents:
            proc.wait(timeout=30)

    def shape(self, mbit: float | None) -> None:
        """Limit this host's link to ``mbit`` Mbit/s in each direction (None: no limit). The bucket holds 2 ms of
        traffic and at least 64 KiB, one TSO segment, so that veth's large segments pass whole."""
        for namespace, device in ((self.name, self.interface), (self.switch, f"s{self.interface}")):
            if mbit is None:
                subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
                continue
            burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
            subprocess.run(
                ["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", f"{QUEUE_MS}ms"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip

    def link_bytes(self) -> dict[str, int]:
        """What this host's interface has sent and received (its kernel counters, headers included), and what
        passed each shaping bucket: ``tx``, ``rx``, ``shaped_tx`` (the host's end), ``shaped_rx`` (the switch's)."""
        stats = _json("-n", self.name, "-s", "link", "show", "dev", self.interface)[0]["stats64"]
        sizes = {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}
        for key, namespace, device in (("shaped_tx", self.name, self.interface),
                                       ("shaped_rx", self.switch, f"s{self.interface}")):  # fmt: skip
            qdiscs = json.loads(subprocess.run(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", device],
                                               check=True, capture_output=True, text=True).stdout)  # fmt: skip
            sizes[key] = sum(q["bytes"] for q in qdiscs if q["kind"] == "tbf")
        return sizes

    def unplug(self) -> None:
        """Take this host's link down on the bridge's side: its packets stop, nobody is told."""
        _ip("-n", self.switch, "link", "set", f"s{self.interface}", "down")

    def plug(self) -> None:
        """Bring this host's link back up."""
        _ip("-n", self.switch, "link", "set", f"s{self.interface}", "up")


class Hosts:
    """``count`` hosts on one bridge; a context manager that deletes everything it made. ``named``: each host's
    processes run under its namespace's name as host name, and every host resolves every name to its address
    (``/etc/netns/NAME/hosts``, which ``ip netns exec`` puts over ``/etc/hosts``)."""

    def __init__(self, count: int, named: bool = False) -> None:
        tag = f"{os.getpid() % 100000}"
        self.switch = f"tpsw{tag}"
        self.hosts = [
            Host(f"tph{tag}-{i}", f"v{tag}h{i}", f"{SUBNET}.{i + 1}", self.switch, named=named) for i in range(count)
        ]
        self.named = named

    def __enter__(self) -> list[Host]:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                _ip("netns", "add", host.name)
                peer = f"s{host.interface}"
                _ip("link", "add", host.interface, "type", "veth", "peer", "name", peer)
                _ip("link", "set", host.interface, "netns", host.name)
                _ip("link", "set", peer, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", peer, "master", "br0")
                _ip("-n", self.switch, "link", "set", peer, "up")
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
                _ip("-n", host.name, "link", "set", host.interface, "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
            if self.named:
                names = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
                for host in self.hosts:
                    folder = Path("/etc/netns") / host.name
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "hosts").write_text(names)
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.kill_all()
        for name in [h.name for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes its veth ends with it
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


_RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
got, first = 0, None
while chunk := conn.recv(1 << 20):
    first = first or time.perf_counter()
    got += len(chunk)
print(got, time.perf_counter() - first, flush=True)
"""
_SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""


def measure_mbit(sender: Host, receiver: Host, nbytes: int, port: int = 29990) -> float:
    """Send ``nbytes`` over TCP from ``sender`` to ``receiver`` and return the rate the receiver saw, in Mbit/s of
    payload, from its first byte to its last (the connection's setup left out)."""
    run = ["ip", "netns", "exec"]
    listener = subprocess.Popen(
        [*run, receiver.name, sys.executable, "-c", _RECEIVE, receiver.address, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "ready"
        subprocess.run(
            [*run, sender.name, sys.executable, "-c", _SEND, receiver.address, str(port), str(nbytes)],
            check=True,
            timeout=120,
        )
        got, seconds = listener.communicate(timeout=120)[0].split()
    finally:
        listener.kill()
    assert int(got) == nbytes, (got, nbytes)
    return nbytes * 8 / float(seconds) / 1e6


def torchrun(
    host: Host,
    script: str,
    args: list[str],
    *,
    nnodes: str,
    nproc: int,
    endpoint: str,
    run_id: str,
    log: Path,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """One host's ``torchrun`` with the c10d rendezvous, tuned for a test: a dead host is noticed after 3 missed
    1-second heartbeats, and a rendezvous with its minimum of hosts closes after 2 seconds more. The host whose
    address is the ``endpoint``'s hosts the rendezvous store (``is_host``: torchrun's own guess compares the
    endpoint with the machine's hostname, which a namespace shares with the others)."""
    is_host = endpoint.rsplit(":", 1)[0] == host.address
    worker, forks = zygote.torchrun_worker(script)  # each worker a fork of the suite's server, in this namespace
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,"
        f"close_timeout=5,is_host={str(is_host).lower()}",
        f"--local-addr={host.address}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        *worker,
        *args,
    ]
    # torch's default, the agent's store shared by every round: the example joins with transpiler.init_distributed,
    # which forms each round's group where no earlier round wrote (pytorch/pytorch#135712; docs/fault_tolerance.md)
    base = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **forks)
    base.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    base.update(env or {})
    return host.run(command, base, log)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; kill the rest and fail if the timeout passes first."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for other in procs:
                try:
                    os.killpg(other.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"torchrun did not finish within {timeout} s") from None
    return codes


def launch_workers(hosts: list[Host], worker: Path, options: list[str], log: Path, port: int, timeout: float) -> None:
    """One ``worker`` per host, ranks in host order, the store on host 0 (torchrun's variables, one rank per
    host); fail with the logs' tails if any fails (``bench/wan.py``, ``bench/planner.py``)."""
    procs = []
    for rank, host in enumerate(hosts):
        env = dict(os.environ, MASTER_ADDR=hosts[0].address, MASTER_PORT=str(port), RANK=str(rank))
        env |= {"WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "HOST_ADDRESS": host.address}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(host.run([sys.executable, str(worker), *options], env, log.with_suffix(f".{rank}.log")))
    codes = wait_all(procs, timeout)
    if any(codes):
        tails = "\n".join(log.with_suffix(f".{r}.log").read_text()[-2000:] for r in range(len(hosts)))
        raise SystemExit(f"a worker failed ({codes}):\n{tails}")
