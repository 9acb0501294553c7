"""kvledger's pure core: events and their codec, hashing, the inventory fold, precedence, residency, the
cost and reuse models, the ceiling, snapshots, the decision codec and settings. Free of sockets, processes and
SQL; it imports no stage, no runtime, no application (tests/test_layers.py)."""
