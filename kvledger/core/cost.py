"""The time-to-first-token cost model: what recomputing a prefix costs, what moving it costs.

A candidate transfer of `blocks` blocks (the part of its prefix beyond what the target
already holds) saves `recompute_ms - transfer_ms`:

- recomputing them is a prefill of `blocks × block_size` tokens at
  `reuse.transfer_source_prefill_token_us` each;
- moving them costs `reuse.transfer_source_gpu_estimated_block_us` per block from a
  source's device tier, `reuse.transfer_source_estimated_block_us` from its host or disk.

Every backend computes these very expressions in this order, so their floats agree bit for
bit: the reference model (`kvledger/core/reuse.py`), the cpu kernels (which compile these
functions themselves with numba), the cuda kernel (`cuda/rank.cu`, the same expressions in
C, checked against the cpu backend by `tests/test_decide_parity.py` on a GPU) and the demo.
"""

from __future__ import annotations


def recompute_ms(blocks: int, block_size: int, prefill_token_us: float) -> float:
    """The prefill time of `blocks` blocks of `block_size` tokens."""
    return (blocks * block_size) * prefill_token_us / 1000.0


def transfer_ms(blocks: int, block_us: float) -> float:
    """The time to move `blocks` blocks at `block_us` each."""
    return blocks * block_us / 1000.0


def block_us(from_device: bool, gpu_block_us: float, other_block_us: float) -> float:
    """What one block costs to move: from a device tier, or from host or disk."""
    return gpu_block_us if from_device else other_block_us
