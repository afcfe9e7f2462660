"""torchft's lighthouse with the options of its ``torchft_lighthouse`` command, from a script that can run in a fork of
the suite's server (``zygote.lighthouse_command``) or in an interpreter of its own. The command itself cannot be
forked: its Rust ``lighthouse_main`` parses the process's own command line (the server's), not ``sys.argv``, so this
runs the server behind it, torchft's ``LighthouseServer``, until the process is ended."""

import argparse
import signal

from torchft._torchft import LighthouseServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--min_replicas", type=int, required=True)
    parser.add_argument("--join_timeout_ms", type=int)
    parser.add_argument("--heartbeat_timeout_ms", type=int)
    args = parser.parse_args()
    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"lighthouse at {server.address()}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
