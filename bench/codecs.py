"""The boundaries' codecs, each beside msgspec's untyped decoding of the same bytes.

    python bench/codecs.py [--repeats 5]

- canonical records (`kvledger.core.events`): one batch of 16 stored blocks (with local
  hashes) and 16 removed blocks, encoded and decoded;
- decision requests (`decide.media`): a single request of 8 blocks as token ids, one of 64
  local hashes, and a batch of 1 024 such token-id requests, decoded into `ReuseRequest`s
  (hashing the token ids included);
- decision answers (`kvledger.core.decision_codec.ANSWER_DECODER`): one answer with two
  candidates, as store reads each KV_DECISIONS record.

Printed: the best of `--repeats` timings per path in µs, and the ratio to the untyped
decode (which only builds dicts and lists, validating nothing; for the record's encode,
msgspec encoding the same record held as plain dicts and lists).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from pathlib import Path

import msgspec

# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.core.decision_codec import ANSWER_DECODER, Answer, Candidate, Overlap  # noqa: E402
from kvledger.decide.serving.media import parse_batch, parse_single  # noqa: E402
from kvledger.core.events import (  # noqa: E402
    EventBatch, Provenance, Removed, Stored, Tier, WorkerId, decode_batch, encode_batch,
)


def best_us(function, number: int, repeats: int) -> float:
    return min(timeit.repeat(function, number=number, repeat=repeats)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(1)

    def u64s(count: int) -> tuple[int, ...]:
        return tuple(rng.getrandbits(64) for _ in range(count))

    batch = EventBatch(WorkerId("prefill-0"), 1, 2, 1767225600.0, 1767225600.1, Provenance.NATIVE, (
        Stored(Tier.DEVICE, u64s(16), rng.getrandbits(64), 16, u64s(16)), Removed(Tier.DEVICE, u64s(16)),
    ))
    record = encode_batch(batch)
    tokens = [rng.randrange(32000) for _ in range(8 * 16)]
    single = json.dumps({"request_id": "bench-1", "block_size": 16, "token_ids": tokens, "target": "prefill-3"}).encode()
    hashes = json.dumps({"request_id": "bench-2", "block_size": 16, "local_hashes": list(u64s(64)),
                         "target": "prefill-3"}).encode()
    many = json.dumps([{"request_id": f"bench-{n}", "block_size": 16, "token_ids": tokens, "target": "prefill-3"}
                       for n in range(1024)]).encode()
    candidates = tuple(Candidate(f"decode-{n}", 0, "device", 40, 30, 12.5, 3.25, 9.25) for n in range(2))
    answer = msgspec.json.encode(Answer(
        "bench-3", 123456, "prefill-3", 10.0, 10,
        {"decode-0": Overlap(40, 40, 0, 40, 0), "decode-1": Overlap(40, 0, 0, 40, 0), "prefill-3": Overlap(10, 10, 0, 10, 0)},
        candidates, candidates[0], "chosen", (), "cpu", "0123456789abcdef",
    ))
    untyped_msgpack, untyped_json = msgspec.msgpack.decode, msgspec.json.decode
    record_values = untyped_msgpack(record)

    rows = [
        ("canonical record, encode", lambda: encode_batch(batch), lambda: msgspec.msgpack.encode(record_values), 50_000),
        ("canonical record, decode", lambda: decode_batch(record), lambda: untyped_msgpack(record), 50_000),
        ("request, 8 blocks of token ids", lambda: parse_single(single), lambda: untyped_json(single), 5_000),
        ("request, 64 local hashes", lambda: parse_single(hashes), lambda: untyped_json(hashes), 20_000),
        ("batch of 1 024 token-id requests", lambda: parse_batch(many), lambda: untyped_json(many), 5),
        ("answer, as store reads it", lambda: ANSWER_DECODER.decode(answer), lambda: untyped_json(answer), 50_000),
    ]
    print("| path | kvledger µs | untyped msgspec µs | ratio |")
    print("|---|---|---|---|")
    for label, ours, untyped, number in rows:
        mine, theirs = best_us(ours, number, args.repeats), best_us(untyped, number, args.repeats)
        print(f"| {label} | {mine:,.2f} | {theirs:,.2f} | {mine / theirs:.2f} |")
    print("(the record encode's yardstick encodes the same record as plain dicts and lists)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
