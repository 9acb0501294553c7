"""Native versus retained: which announcement of a block wins, and what each one counts for.

A worker's blocks are announced by the engine itself (native provenance) and, optionally,
by a retaining layer beside it (retained: e.g. an offload connector that keeps blocks the
engine evicted). The two are folded side by side (`kvledger/core/fold.py`), and these rules
decide between them; every backend reads the fold through `holds`, so they all agree:

1. The engine is authoritative for topology. Where a retained record of a block disagrees
   with the engine's own record of it (another parent or another sequence hash), the
   retained one is kept for audit only (`conflict`) and never indexed — whichever arrives
   first: a native store demotes the retained copies it contradicts.
2. A parent is looked up in the native topology first, then the retained one
   (`PARENT_LOOKUP`); a parent neither knows starts a new chain.
3. A removal, a clear and a restart touch only their own provenance: a retaining layer
   dropping a block never takes the engine's copy with it, and the other way round.
4. Execution credit and transfer sources count native blocks only (`CREDITED`): what the
   engine says it holds is what it can serve or send.
5. The baseline — the prefix a target need not be sent — counts native and retained
   device blocks (`BASELINE_CLASSES`): a retained device copy still spares a transfer
   after a native eviction.
"""

from __future__ import annotations

from kvledger.core.events import Provenance, Tier

NATIVE, RETAINED = Provenance.NATIVE, Provenance.RETAINED

PARENT_LOOKUP: tuple[Provenance, ...] = (NATIVE, RETAINED)
CREDITED: Provenance = NATIVE
BASELINE_CLASSES: tuple[tuple[Provenance, Tier], ...] = ((NATIVE, Tier.DEVICE), (RETAINED, Tier.DEVICE))


def contradicts(engine_parent: int | None, engine_sequence: int, parent: int | None, sequence: int) -> bool:
    """Whether a record placing a block under (`parent`, `sequence`) disagrees with the engine's own placement."""
    return engine_parent != parent or engine_sequence != sequence
