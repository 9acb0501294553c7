"""kvledger's shared core: events, hashing, the fold, the reuse model, snapshots, the
decision codec and settings; free of sockets, processes and SQL.

Beside it: `kvledger.runtime` (NATS, HTTP, processes), `kvledger.client` (the decide client
a router uses), `kvledger.sim` (simulated engines) and `kvledger.app` (the command line).
"""

__version__ = "0.1.0"
