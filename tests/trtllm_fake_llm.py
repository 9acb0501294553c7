"""A stand-in TensorRT-LLM `LLM` for `kvledger trtllm-forward --llm trtllm_fake_llm:build`: it yields, poll by
poll, what TensorRT-LLM's serializer returned in a golden fixture (TRTLLM_FAKE_FIXTURE names which)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path


class FakeLLM:
    def __init__(self, polls: list[list[dict]]) -> None:
        self.polls = list(polls)

    async def get_kv_cache_events_async(self, timeout: float):
        if not self.polls:
            await asyncio.sleep(min(timeout, 0.05))
            return
        for event in self.polls.pop(0):
            yield event


def build() -> FakeLLM:
    path = Path(__file__).parent / "golden" / "trtllm" / os.environ.get("TRTLLM_FAKE_FIXTURE", "pull_host_tier.json")
    return FakeLLM(json.loads(path.read_text())["polls"])
