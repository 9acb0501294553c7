"""kvledger in a router team's integration tests: `KvledgerStack` runs NATS, kvledger's
image (decide, and with PostgreSQL store too) and optionally PostgreSQL in containers.

Needs Docker and testcontainers (`pip install 'kvledger[test]'` or `testcontainers`);
docs/operations.md, "kvledger in your integration tests", has an example.
"""

from kvledger.testing.stack import KvledgerStack

__all__ = ["KvledgerStack"]
