"""What the benches and the tests share to run real worlds: launching ranks with a hard timeout (``launch.py``),
forking them from a server that has imported torch and the package already (``zygote.py``, ``fork_server.py``,
``forked.py``), several hosts on one machine as network namespaces with shaped links (``hosts.py``), and torchft's
lighthouse (``lighthouse.py``). The tests' own session worlds build on these (``tests/worlds.py``)."""
