"""stormd's public surface for its clients: what a process talking to the daemon must share with it.

The client library (``storm``) imports the daemon only through this package,
so the daemon's internals (its store, allocator, spill, server, settings) can
change without it; the daemon, stormctl and the benchmarks import the same
modules, so every side reads one definition of each:

- ``protocol``: every message, its fields, the error codes, pack/unpack.
- ``pool``: the shared-memory host pool (``SharedPool``): the daemon creates it,
  a client attaches to it, the embedded store maps an anonymous one.
- ``endpoint``: where the socket lives (``normalize_endpoint``, ``runtime_dir``,
  ``ipc_path``, ``socket_is_live``).
- ``sizes``: ``parse_size`` and ``format_size``.
- ``curve``: a client's CURVE keys for a tcp:// daemon.
- ``cuda``: the CUDA runtime binding both sides use (IPC handle bytes, events,
  the pool's page-lock).

The one other way in is ``stormd.embedded``, the daemon's request handling for
the embedded store inside a client process. tests/test_imports.py holds the
client to both.
"""
