"""llm-d's indexer service (`indexer.v1.IndexerService/GetPodScores`), answered from decide's index.

llm-d's indexer tokenizes the prompt (as vLLM renders a completion prompt: special tokens
added), cuts the tokens into full blocks, looks the blocks up, and scores each pod with its
`LongestPrefix` scorer: walking the blocks from the first, a pod scores the weight of the
best tier it holds each block on (`gpu` 1.0, `cpu` 0.8 by default, a tier without a weight
1.0) until the first block it lacks; only pods holding the first block score at all.

Here the tokenizer is the operator's `tokenizer.json` for the model (Hugging Face
`tokenizers`), the blocks are kvledger's own content hashes of the tokens (what the index
keeps for every engine, whatever hash the engine published), and a pod is the set of
publishers the operator names for it: its ranks count as one pod, as llm-d keys its
index by pod. llm-d salts its block keys with the model name, so a model it has no blocks
for scores nobody; a model kvledger has no tokenizer for answers the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from kvledger.core.events import WorkerId
from kvledger.core.hashing import local_block_hashes, sequence_hashes

from kvledger.decide.inventory.table import lookup_rows
from kvledger.decide.inventory.index import NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST
from kvledger.decide.inventory.rows import dense_planes
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.routers.protos import indexer_pb2 as pb

SERVICE = "indexer.v1.IndexerService"
# llm-d's DefaultKVCacheBackendConfig; a tier missing here weighs 1.0, as in its scorer.
DEFAULT_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8}
# kvledger's native tiers under the device-tier names llm-d gives them (the engine's medium, lower-cased).
TIER_NAMES = ((NATIVE_DEVICE, "gpu"), (NATIVE_HOST, "cpu"), (NATIVE_DISK, "disk"))


@attrs.frozen
class LlmdModel:
    """One model llm-d may ask about: how to tokenize its prompts, its block size, and its pods.

    `pods` maps a publisher (or a worker name, `publisher/rank`) to its pod identifier;
    empty, every publisher in the index is a pod named after itself.
    """

    tokenizer: object  # a tokenizers.Tokenizer
    block_size: int
    pods: Mapping[str, str] = attrs.field(factory=dict)

    def pod_of(self, worker: WorkerId) -> str | None:
        if not self.pods:
            return worker.publisher
        return self.pods.get(worker.name, self.pods.get(worker.publisher))

    def tokens(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids


def pod_scores(index: IndexReader, model: LlmdModel, tokens: Sequence[int], pod_identifiers: Sequence[str],
               weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> dict[str, float]:
    """llm-d's `LongestPrefix` scores of the pods holding the prompt's first block (see the module's docstring)."""
    local = local_block_hashes(tokens, model.block_size)
    if not local or not index.workers:
        return {}
    sequences = np.array(sequence_hashes(local), dtype=np.uint64)
    rows = lookup_rows(index.table_keys, index.table_rows, index.table_bits, sequences).astype(np.int64)
    planes = dense_planes(index.holders, index.spilled, rows, index.words)  # blocks × classes × words
    wanted = set(pod_identifiers)
    # Per pod and block, the best weight of a tier one of its workers holds the block on (0: none).
    best: dict[str, np.ndarray] = {}
    for position, name in TIER_NAMES:
        weight = weights.get(name, 1.0)
        bits = np.unpackbits(np.ascontiguousarray(planes[:, position, :]).astype("<u8").view(np.uint8),
                             axis=1, bitorder="little")
        for slot in np.flatnonzero(bits[:, : len(index.workers)].any(axis=0)).tolist():
            pod = model.pod_of(index.workers[slot])
            if pod is None or (wanted and pod not in wanted):
                continue
            held = bits[:, slot].astype(bool)
            row = best.setdefault(pod, np.full(len(local), -1.0))
            np.maximum(row, np.where(held, weight, -1.0), out=row)
    scores = {}
    for pod, row in best.items():
        if row[0] < 0:
            continue  # only pods holding the first block enter llm-d's chain
        missing = np.flatnonzero(row < 0)
        chain = row[: missing[0]] if missing.size else row
        scores[pod] = float(chain.sum())
    return scores


def scores_response(scores: Mapping[str, float]) -> pb.GetPodScoresResponse:
    """The answer, best pod first (llm-d's order is a Go map's, i.e. none)."""
    response = pb.GetPodScoresResponse()
    for pod, score in sorted(scores.items(), key=lambda item: (-item[1], item[0])):
        response.scores.add(pod=pod, score=score)
    return response
