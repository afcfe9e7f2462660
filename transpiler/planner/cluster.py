"""What the planner plans for: the hosts, the ranks on each, their device and memory, and the links between them.

A cluster has two link levels, ``host`` (between ranks of one host) and ``network`` (between hosts), each a
bandwidth per rank each way and a latency. A collective over a group is priced on the slowest level the group
spans, by the textbook ring formulas (:meth:`Link.seconds`); where a calibration run measured a collective at a
level (``transpiler calibrate``, ``planner/calibrate.py``), its fitted ``alpha + beta * bytes`` replaces the
formula. The same file can carry the model's measured compute (:class:`ComputeTimes`), so a plan after
calibration runs nothing.

Written by hand as JSON::

    {"hosts": 4, "ranks_per_host": 1, "device": "cpu", "memory_per_rank_mib": 2048,
     "links": {"host": {"mbit": 100000, "latency_us": 5}, "network": {"mbit": 100, "latency_us": 50}}}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transpiler.errors import ConfigurationError

MIB = 1024 * 1024
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "p2p")  # what a link is priced for
LEVELS = ("host", "network")


FIELDS = ("hosts", "ranks_per_host", "device", "memory_per_rank_mib", "links", "compute", "programs")


def ring(kind: str, ranks: int) -> tuple[int, float]:
    """A ring's rounds and the share of the bytes each rank sends for one ``kind`` collective over ``ranks``."""
    return {
        "all_reduce": (2 * (ranks - 1), 2 * (ranks - 1) / ranks),
        "all_gather": (ranks - 1, (ranks - 1) / ranks),
        "all_to_all": (ranks - 1, (ranks - 1) / ranks),
        "reduce_scatter": (ranks - 1, (ranks - 1) / ranks),
        "p2p": (1, 1.0),
    }[kind]


@dataclass(frozen=True)
class Link:
    """One link level: ``bandwidth`` in bytes per second per rank each way, ``latency`` in seconds per message, and
    the collectives measured on it, ``{kind: (alpha, beta, ranks)}`` (seconds, and seconds per byte of the whole
    tensor: the one all-reduced or exchanged, an all-gather's output; over a group of ``ranks``)."""

    bandwidth: float
    latency: float
    measured: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """What one ``kind`` collective of ``nbytes`` per rank costs over ``ranks`` ranks on this level: the
        measured fit where there is one for that group size, else a ring's rounds and bytes (all-reduce: 2(n−1)
        rounds moving 2(n−1)/n of the bytes; all-gather, reduce-scatter and all-to-all: n−1 rounds and (n−1)/n;
        point-to-point: one message of all of them). A fit's intercept is at least the ring's rounds at the link's
        latency: the fits of the collectives other than the all-reduce come out at 0 where small sizes are noisy,
        which priced a layout of four collectives like one of two at the same bytes."""
        if ranks <= 1 and kind != "p2p":
            return 0.0
        rounds, share = ring(kind, ranks)
        if kind in self.measured and self.measured[kind][2] == ranks:
            alpha, beta, _ = self.measured[kind]
            return max(alpha, rounds * self.latency) + beta * nbytes
        return rounds * self.latency + share * nbytes / self.bandwidth


@dataclass(frozen=True)
class ComputeTimes:
    """The model's step measured on one rank of the cluster at the example batch (seconds; medians): forward with
    the loss, backward, and the optimizer's update. ``under_load``: measured with every rank of the host
    computing at once (a calibration run), not alone."""

    forward: float
    backward: float
    update: float
    under_load: bool = False

    @property
    def step(self) -> float:
        return self.forward + self.backward + self.update


@dataclass(frozen=True)
class ProgramTimes:
    """One program's step on a GPU (``planner/programs.py``), uncaptured: seconds per step (``wall``,
    synchronised), kernels' seconds per step (``device``), kernels per step, the peak bytes allocated, and the
    first call's seconds (tracing, the passes, the compile)."""

    wall: float
    device: float
    kernels: float
    peak: int
    first_call: float


@dataclass(frozen=True)
class Cluster:
    """Hosts of ``ranks_per_host`` ranks each; ``device`` ``"cpu"`` or ``"cuda"``; ``memory_per_rank`` bytes a
    rank may use; the two link levels; the model's compute where a calibration measured it, and on a GPU its
    program's (``programs``: ``"default"``, ``"cuda_graph"`` where captured, ``"compile"`` where compiled)."""

    hosts: int
    ranks_per_host: int
    memory_per_rank: int
    host_link: Link
    network_link: Link
    device: str = "cpu"
    compute: ComputeTimes | None = None
    programs: dict[str, ProgramTimes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ConfigurationError(
                f"a cluster has at least one host of one rank, got {self.hosts} × {self.ranks_per_host}."
            )
        if self.memory_per_rank <= 0:
            raise ConfigurationError(
                "memory_per_rank must be a positive number of bytes (memory_per_rank_mib in JSON)."
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigurationError(f"device is 'cpu' or 'cuda', got {self.device!r}.")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def link_for(self, ranks: int, contiguous: bool = True) -> Link:
        """The slowest level a group of ``ranks`` ranks spans: contiguous ranks stay within a host while they fit
        one; a strided group (one rank of each of several stages) crosses hosts once there is more than one."""
        within = ranks <= self.ranks_per_host if contiguous else self.hosts == 1
        return self.host_link if within else self.network_link

    def collective_seconds(self, kind: str, nbytes: float, ranks: int, contiguous: bool = True) -> float:
        return self.link_for(ranks, contiguous).seconds(kind, nbytes, ranks)

    def level_of(self, ranks: int, contiguous: bool = True) -> str:
        return "host" if self.link_for(ranks, contiguous) is self.host_link else "network"

    def with_compute(self, compute: ComputeTimes) -> Cluster:
        return dataclasses.replace(self, compute=compute)

    def to_dict(self) -> dict[str, Any]:
        def link(lk: Link) -> dict[str, Any]:
            out: dict[str, Any] = {"mbit": round(lk.bandwidth * 8 / 1e6, 6), "latency_us": round(lk.latency * 1e6, 6)}
            if lk.measured:
                out["measured"] = {k: list(v) for k, v in lk.measured.items()}
            return out

        data: dict[str, Any] = {
            "hosts": self.hosts,
            "ranks_per_host": self.ranks_per_host,
            "device": self.device,
            "memory_per_rank_mib": self.memory_per_rank / MIB,
            "links": {"host": link(self.host_link), "network": link(self.network_link)},
        }
        if self.compute is not None:
            data["compute"] = dataclasses.asdict(self.compute)
        if self.programs:
            data["programs"] = {flag: dataclasses.asdict(times) for flag, times in self.programs.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """A cluster from its JSON form (module docstring); an error names what is missing or wrong."""
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ConfigurationError(f"unknown cluster fields {sorted(unknown)}; see transpiler/planner/cluster.py.")
        try:
            links = {level: _link(level, data["links"].get(level)) for level in LEVELS}
            compute = ComputeTimes(**data["compute"]) if "compute" in data else None
            programs = {flag: ProgramTimes(**times) for flag, times in data.get("programs", {}).items()}
            if "default" not in programs and programs or set(programs) - {"default", "cuda_graph", "compile"}:
                raise ValueError(f"programs: 'default' always, 'cuda_graph', 'compile'; got {sorted(programs)}")
            return cls(
                hosts=int(data["hosts"]),
                ranks_per_host=int(data.get("ranks_per_host", 1)),
                memory_per_rank=int(float(data["memory_per_rank_mib"]) * MIB),
                host_link=links["host"],
                network_link=links["network"],
                device=data.get("device", "cpu"),
                compute=compute,
                programs=programs,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigurationError(
                f"a cluster needs hosts, memory_per_rank_mib and links.host/links.network with mbit and latency_us "
                f"({type(error).__name__}: {error})."
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigurationError(f"cannot read the cluster file {path}: {error}") from None


def _link(level: str, data: dict[str, Any] | None) -> Link:
    if data is None:
        raise KeyError(f"links.{level}")
    mbit, latency = float(data["mbit"]), float(data.get("latency_us", 0.0)) * 1e-6
    if mbit <= 0 or latency < 0:
        raise ValueError(f"links.{level}: mbit must be positive and latency_us not negative")
    measured = {k: (float(v[0]), float(v[1]), int(v[2])) for k, v in data.get("measured", {}).items()}
    bad = set(measured) - set(COLLECTIVES)
    if bad:
        raise ValueError(f"links.{level}.measured: unknown collectives {sorted(bad)} (known: {COLLECTIVES})")
    return Link(bandwidth=mbit * 1e6 / 8, latency=latency, measured=measured)


def simple_cluster(
    hosts: int, ranks_per_host: int, network_mbit: float, memory_mib: float, device: str = "cpu"
) -> Cluster:
    """A cluster from four numbers: links within a host at 100 Gbit/s and 5 µs, between hosts at
    ``network_mbit`` and 50 µs."""
    return Cluster(
        hosts=hosts,
        ranks_per_host=ranks_per_host,
        memory_per_rank=int(memory_mib * MIB),
        host_link=Link(bandwidth=100e9 / 8, latency=5e-6),
        network_link=Link(bandwidth=network_mbit * 1e6 / 8, latency=50e-6),
        device=device,
    )
