"""A hybrid model's residency rule: which KV-cache groups make a block "held".

A hybrid model (vLLM's several KV-cache groups: full attention beside sliding-window,
Mamba or chunked-local groups) stores each block once per group under the same hash,
and each group evicts on its own. vLLM counts a prefix as a cache hit when every
full-attention group holds every block of it; a sliding-window group only needs the
blocks inside its window, so its evicting older blocks does not shorten the prefix, and
a Mamba group keeps one state per position. So here:

- a group whose declared kind is full attention (or undeclared, or unknown) *decides*;
- a block is held on a tier when every deciding group seen on that tier holds it (in any
  ownership: two offload tiers holding one hash are two copies of one block);
- a worker with no deciding group on a tier (a pure sliding-window or Mamba model)
  holds a block when any of its groups does.

vLLM also needs a sliding-window group to still hold the last blocks of the window
ending at the hit; a per-block index cannot express that, so kvledger's prefix is an
upper bound there (docs/decide.md). The fold applies this rule in `holds`; the reference
model, the cpu and the cuda backends all read `holds`, so they agree by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs

# vLLM's KVCacheSpecKind values whose evictions do not shorten a cache hit: windowed
# attention and state-space layers. Every other kind (full_attention, mla_attention,
# sink_full_attention, unknown, an undeclared kind) decides residency.
NON_DECIDING_KINDS = frozenset({
    "sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba",
    "encoder_only_attention", "cross_attention",
})


def decides(spec_kind: str | None) -> bool:
    """Whether a group of this declared kind decides whether a block is held."""
    return spec_kind is None or spec_kind.lower() not in NON_DECIDING_KINDS


@attrs.frozen
class ResidencyRule:
    """What holding a block on one tier takes: every one of `groups`, or (`every` false) any one."""

    groups: tuple[int, ...]
    every: bool

    def holds(self, group_holds: Callable[[int], bool]) -> bool:
        if self.every:
            return all(group_holds(group) for group in self.groups)
        return any(group_holds(group) for group in self.groups)


def rule_for(groups: Iterable[int], kind_of: Mapping[int, str | None]) -> ResidencyRule:
    """The rule for a tier on which `groups` were seen, given each group's declared kind."""
    present = tuple(sorted(groups))
    deciding = tuple(group for group in present if decides(kind_of.get(group)))
    return ResidencyRule(deciding, True) if deciding else ResidencyRule(present, False)
