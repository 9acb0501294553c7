"""Which KV_EVENTS subjects one `kvledger store` shard projects (`store.shard` = "K/N").

Every shard reads the whole stream and keeps the subjects whose publisher hashes to it, so
a publisher's rows (event_log, block_residency, workers, uncertain_periods) are written by
one shard only and shards never contend for a row. The hash is xxh3_64 of the publisher
token: stable across processes and Python versions, unlike hash().
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs
import xxhash

from kvledger.core.settings import SettingsError, StoreSettings

_PUBLISHER_TOKEN = 2  # kv.ev.<publisher>.<dp_rank>[.<provenance>]


class ShardError(SettingsError):
    """A `store.shard` value that is not "K/N" with 0 <= K < N <= 64."""


@attrs.frozen
class Shard:
    """Shard `index` of `count`; 0/1 is the single store, which owns everything."""

    index: int = 0
    count: int = 1

    @property
    def single(self) -> bool:
        return self.count == 1

    def owns_publisher(self, publisher: str) -> bool:
        return self.count == 1 or xxhash.xxh3_64_intdigest(publisher.encode()) % self.count == self.index

    def owns(self, subject: str) -> bool:
        """Whether this shard projects a message on `subject`, judged by the subject alone (no decode)."""
        if self.count == 1:
            return True
        tokens = subject.split(".", _PUBLISHER_TOKEN + 1)
        if len(tokens) <= _PUBLISHER_TOKEN:  # no publisher to hash: shard 0 keeps it as a dead letter
            return self.index == 0
        return self.owns_publisher(tokens[_PUBLISHER_TOKEN])

    def durable(self, base: str) -> str:
        """The shard's own durable consumer name (the single store keeps the historical name)."""
        return base if self.count == 1 else f"{base}-{self.index}-of-{self.count}"

    @property
    def checkpoint_name(self) -> str:
        # "events" for the single store, so databases written before shards existed keep working.
        return "events" if self.count == 1 else f"events-{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


SINGLE = Shard()


def parse_shard(text: str) -> Shard:
    """A `store.shard` value as a Shard; ShardError names the setting when it is not "K/N"."""
    problem = StoreSettings.shard_problem(text)
    if problem is not None:
        raise ShardError(f"setting store.shard: {problem}")
    index, count = text.split("/")
    return Shard(int(index), int(count))


_SHARD_CHECKPOINT = re.compile(r"events-([0-9]+)-of-([0-9]+)")


def sharded_events_checkpoint(checkpoints: Mapping[str, int]) -> int | None:
    """How far KV_EVENTS is projected when shards wrote it: the least of their checkpoints
    (a shard without a row yet counts as 0); None when no shard checkpoint exists.

    Every shard passes every seq, so the least checkpoint is the seq below which all of
    the database is complete.
    """
    least: int | None = None
    for name, seq in checkpoints.items():
        match = _SHARD_CHECKPOINT.fullmatch(name)
        if match is None:
            continue
        count = int(match[2])
        missing = any(Shard(index, count).checkpoint_name not in checkpoints for index in range(count))
        seq = 0 if missing else seq
        least = seq if least is None else min(least, seq)
    return least
