"""A server that forks torchrun's workers (and torchft's lighthouse, ``bench/harness/lighthouse.py``) from the suite's
imported interpreter (``bench/harness/zygote.py``).

torchrun starts every worker as a new interpreter, which spends 5 to 6 s of CPU importing torch and the package
before its first line of work; the fault-tolerance and multi-host tests start about a hundred. Their torchrun runs
``bench/harness/forked.py SCRIPT ARGS`` instead, a stdlib-only client that sends this server its arguments, environment,
folder, standard streams and namespaces. The server forks a worker that becomes ``python -u SCRIPT ARGS``
in them (in the client's network, host name and mount namespaces: a host of ``bench/harness/hosts.py``), tells the
client its pid (the client forwards torchrun's signals to it), and when the worker ends sends
the client its wait status, which the client then ends with. A client that dies (torchrun's SIGKILL) takes its
worker with it. The server has no thread, so each fork is as clean as the server itself.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback

from bench.harness import zygote
from bench.harness.forked import HEADER, NAMESPACES, PID, STATUS, exactly

STDIN, STDOUT, STDERR = range(3)  # the client's descriptors: these, then its namespaces


def serve(address: str) -> None:
    """Listen at ``address`` (a Unix socket) and fork a worker for each client, until this process is ended."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{address}.new")
    listener.listen(64)
    os.rename(f"{address}.new", address)  # the address appears once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                _start(listener.accept()[0], selector)
            elif key.data[0] == "client":  # the client hung up before its worker ended: it was killed
                selector.unregister(key.fileobj)
                key.fileobj.close()
                _kill(key.data[1], signal.SIGKILL)
            else:
                _, pid, conn = key.data
                selector.unregister(key.fileobj)
                os.close(key.fd)
                status = os.waitpid(pid, 0)[1]
                if conn.fileno() != -1:
                    selector.unregister(conn)
                    with contextlib.suppress(OSError):  # a client killed with its worker (a lost host) hears nothing
                        conn.sendall(STATUS.pack(status))
                    conn.close()


def _start(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    """Read one client's request and fork its worker; watch the worker's end and the client's."""
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3 + len(NAMESPACES))
    request = json.loads(exactly(conn, HEADER.unpack(header)[0]))
    pid = os.fork()
    if pid == 0:
        for key in list(selector.get_map().values()):  # the server's descriptors are not the worker's
            key.fileobj.close() if isinstance(key.fileobj, socket.socket) else os.close(key.fd)
        selector.close()
        conn.close()
        _worker(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(PID.pack(pid))
    pidfd = os.pidfd_open(pid)
    selector.register(conn, selectors.EVENT_READ, ("client", pid))
    selector.register(pidfd, selectors.EVENT_READ, ("worker", pid, conn))


def _worker(request: dict, fds: list[int]) -> None:
    """In the fork: enter the client's namespaces and a session of its own, become its ``python -u SCRIPT ARGS``, run
    it, and leave as the interpreter would (non-daemon threads joined, exit handlers run), without returning."""
    code, interrupted, libc = 1, False, ctypes.CDLL(None, use_errno=True)
    try:
        for kind, fd in zip(NAMESPACES, fds[3:]):
            if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino and libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns into the client's {kind} namespace")
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        zygote.become(
            request["argv"], request["env"], request["cwd"], stdout=fds[STDOUT], stderr=fds[STDERR], stdin=fds[STDIN]
        )
        for fd in fds:
            os.close(fd)
        try:
            zygote.run_as_main(request["argv"])
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except BaseException as error:
            sys.excepthook(*sys.exc_info())  # as the interpreter reports it (torch.distributed prefixes the rank)
            interrupted = isinstance(error, KeyboardInterrupt)
        # as the interpreter ends: threading's own exit hooks (which tell executors' workers to stop: torchft's
        # manager keeps some) and the joins of non-daemon threads, then the exit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # the fork could not become the worker
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if interrupted:  # the interpreter ends by SIGINT then
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
