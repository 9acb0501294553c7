"""kvledger: one installed namespace, its layers one folder each.

`kvledger.core` (events, hashing, the fold, the reuse model, snapshots, the decision codec and
settings; free of sockets, processes and SQL); `kvledger.runtime` (NATS, HTTP, processes);
the stages `kvledger.ingest`, `kvledger.store` and `kvledger.decide` (the repository's top-level
folders, linked here); `kvledger.client` (the decide client a router uses), `kvledger.sim`
(simulated engines), `kvledger.testing` (kvledger's image for users' own tests) and
`kvledger.app` (the command line).
"""

__version__ = "0.1.0"
