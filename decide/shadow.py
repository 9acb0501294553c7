"""Shadow decisions: what reuse would choose, answered beside every live answer and recorded with it.

With `decide.shadow` on, each batch decide answers is ranked a second time, under the
shadow reuse settings (`decide.shadow_settings`, or the live ones with both enable flags
on), with the same backend against the same index, for the request's own target, else
its `fallback` (where its load balancer places it), else as asked. The reply is the live answer alone; the record in KV_DECISIONS carries the
would-be answer in its `Kvledger-Shadow` header, and its relied-on prefix covers the
shadow's chosen source too, so store can judge it as it judges real hints
(docs/audit.md, "Shadow decisions").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from kvledger.decision_codec import shadow_header
from kvledger.reuse import ReuseRequest
from kvledger.settings import ReuseSettings, Settings, enabled_reuse, reuse_settings_from, SettingsError

from decide.backend import RankingBackend
from decide.ranked import Clock
from decide.startup import StartupError


def shadow_reuse(settings: Settings) -> ReuseSettings | None:
    """The shadow reuse settings `settings` ask for, or None when shadow decisions are off."""
    if not settings.decide.shadow:
        return None
    if settings.decide.shadow_settings is None:
        return enabled_reuse(settings.reuse)
    try:
        return reuse_settings_from(settings.decide.shadow_settings, settings.reuse)
    except SettingsError as error:
        raise StartupError(f"decide.shadow_settings: {error}") from None


def shadow_requests(requests: Sequence[ReuseRequest]) -> Sequence[ReuseRequest]:
    """The requests as the shadow ranks them: a request naming no target goes to its `fallback`, where
    its load balancer places it without kvledger's credit (reuse transfers a prefix to where a
    request is placed); without either, as asked (the most-credited worker is the target)."""
    if not any(request.target is None and request.fallback is not None for request in requests):
        return requests
    return [attrs.evolve(request, target=request.fallback) if request.target is None and request.fallback is not None
            else request for request in requests]


class ShadowDecisions:
    """Ranks batches under the shadow settings; `headers` and `relied_prefixes` go on the records."""

    def __init__(self, reuse: ReuseSettings) -> None:
        self.reuse = reuse

    def answer(
        self, backend: RankingBackend, requests: Sequence[ReuseRequest], *, clock: Clock = time.perf_counter,
    ) -> tuple[list[str], list[bytes]]:
        """Per request, the `Kvledger-Shadow` header of its would-be answer and that answer's relied-on prefix."""
        texts = backend.answer_texts(shadow_requests(requests), self.reuse, clock=clock)
        return [shadow_header(answer) for answer in texts.answers], texts.relied_prefixes
