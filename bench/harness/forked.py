"""A process forked by the suite's server (``bench/harness/fork_server.py``): ``python -u bench/harness/forked.py
SCRIPT ARGS`` (or ``-m MODULE ARGS``) runs ``SCRIPT ARGS`` as ``python -u`` would, in a fork of an interpreter that has
imported torch and the package already. torchrun names it for its workers; the quorum tests start the lighthouse
with it.

This client imports the standard library only. It sends the server (``FORK_SERVER``, a Unix socket) its arguments,
environment, folder, standard streams and namespaces (a host's network, name and files), forwards the signals
it gets to the fork, and ends as the fork ended: with its exit code, or killed by the same signal.
Without ``FORK_SERVER`` it becomes ``python -u SCRIPT ARGS`` itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!Q")  # the request's length; the client's descriptors travel with it
PID, STATUS = struct.Struct("!q"), struct.Struct("!i")  # what the server answers: the worker's pid, then its status
NAMESPACES = ("net", "uts", "mnt")  # a host's (bench/harness/hosts.py): its network, its host name, its /etc/hosts
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def exactly(conn: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``conn``; a peer that hangs up first is an error."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side hung up")
        data += chunk
    return data


def main() -> None:
    address = os.environ.get("FORK_SERVER")
    if not address:
        os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    namespaces = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in NAMESPACES]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.connect(address)
        socket.send_fds(server, [HEADER.pack(len(request))], [0, 1, 2, *namespaces])
        server.sendall(request)
        for fd in namespaces:
            os.close(fd)
        (pid,) = PID.unpack(exactly(server, PID.size))
        for sig in FORWARDED:
            signal.signal(sig, lambda received, _: os.kill(pid, received))
        (status,) = STATUS.unpack(exactly(server, STATUS.size))
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
