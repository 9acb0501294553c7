"""The `cuda` ranking backend: the index mirrored in device memory, one launch per batch.

Kernels live in `cuda/*.cu` and are compiled at run time by NVRTC (through cuda.core) to a
CUBIN for the device's own `sm_<major><minor>`: PTX from a newer NVRTC may not load on an
older driver, while a CUBIN for the exact architecture needs no JIT at all. Each
architecture is compiled once per process. The table and the rows live on the device,
every row as bitmasks however the index keeps it (`InventoryIndex.dense_rows`); after the
first upload only dirty table slots and rows travel, applied by the scatter kernels. The host side is shared with cpu: `decide.ranking.kernels.chain_hashes` chains the
requests' hashes before the launch and `decide.ranking.ranked.AnswerBatch` writes the answers
with the same compiled JSON writer.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Sequence

import attrs
import numpy as np

from kvledger.core.reuse import Decision, ReuseRequest
from kvledger.core.settings import ReuseSettings
from kvledger.runtime.resources import data_dir

from kvledger.decide.inventory.index import CLASSES
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.ranking.cpu import WARM_UP_REQUEST
from kvledger.decide.ranking.ranked import (
    PREFIX_CLASSES,
    AnswerBatch,
    AnswerTexts,
    Clock,
    RankedBatch,
    sequence_hashes_of,
    overlaps_of,
    requested_targets,
    source_tier_codes,
)

KERNEL_NAMES = ("scatter_table", "scatter_rows", "rank_requests")
RANK_THREADS = 256
SCATTER_THREADS = 256
# A prefix never exceeds int32, so a larger minimum means the same as this one.
INT32_MAX = 2**31 - 1


class CudaUnavailable(RuntimeError):
    """No CUDA device answers here (or the cuda backend could not start); the message says why."""


class CompileError(RuntimeError):
    """NVRTC refused a kernel or warned about it; the message carries the compiler log."""


def kernel_sources() -> dict[str, str]:
    """Every `cuda/*.cu` source, by file name."""
    return {path.name: path.read_text() for path in sorted(data_dir("cuda").glob("*.cu"))}


def compile_options(arch: str) -> object:
    from cuda.core import ProgramOptions

    # --fmad=false: a fused multiply-add rounds once where the reference rounds twice.
    return ProgramOptions(name="kvledger_rank", arch=arch, std="c++17", fma=False)


def compile_source(source: str, arch: str) -> tuple[object, str]:
    """Compile one source to a CUBIN for `arch` ("sm_90"); raise CompileError on an error or any warning."""
    from cuda.core import Program

    log = io.StringIO()
    try:
        code = Program(source, "c++", compile_options(arch)).compile("cubin", logs=log)
    except Exception as error:  # NVRTC reports failures as exceptions carrying its log
        raise CompileError(f"NVRTC failed for {arch}: {error}\n{log.getvalue()}") from None
    text = log.getvalue().strip()
    if text:
        raise CompileError(f"NVRTC warned for {arch}; warnings are errors here:\n{text}")
    return code, text


@functools.cache
def _compiled(arch: str) -> object:
    """The CUBIN of rank.cu for one architecture, compiled once per process."""
    code, _ = compile_source(kernel_sources()["rank.cu"], arch)
    return code


@functools.cache
def device_unavailable_reason() -> str | None:
    """None when a CUDA device answers, else why not (no driver, no device)."""
    try:
        from cuda.core import Device

        device = Device(0)
        device.set_current()
        return None
    except Exception as error:  # no driver library, no device, or a driver too old
        return f"no CUDA device answers ({type(error).__name__}: {error})"


def _check(result: tuple) -> object:
    from cuda.bindings import driver

    error = result[0]
    if error != driver.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable(f"CUDA driver call failed: {error}")
    return result[1] if len(result) > 1 else None


class _DeviceArrays:
    """Device buffers that grow on demand and are reused between batches.

    Every allocation, copy and release goes on the backend's one stream, in order with the
    kernels: cuda.core's streams are non-blocking by default, so a copy on the legacy
    default stream could still be in flight when a kernel on this one reads its buffer.
    """

    def __init__(self, device: object, stream: object) -> None:
        self._device = device
        self._stream = stream
        self._buffers: dict[str, object] = {}

    def get(self, name: str, nbytes: int) -> object:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < max(nbytes, 8):
            if buffer is not None:
                buffer.close(self._stream)
            # cuda.core 1.x requires the stream an allocation is ordered on.
            size = max(nbytes, 8) * 2 if buffer is not None else max(nbytes, 8)
            buffer = self._device.allocate(size, stream=self._stream)
            self._buffers[name] = buffer
        return buffer

    def upload(self, name: str, array: np.ndarray) -> object:
        from cuda.bindings import driver

        array = np.ascontiguousarray(array)
        buffer = self.get(name, array.nbytes)
        if array.nbytes:
            # From pageable memory the call returns once the bytes are staged, so `array`
            # may go away at once; the copy itself runs in stream order.
            _check(driver.cuMemcpyHtoDAsync(int(buffer.handle), array.ctypes.data, array.nbytes, self._stream.handle))
        return buffer

    def download(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        from cuda.bindings import driver

        array = np.empty(count, dtype=dtype)
        if array.nbytes:
            # Into pageable memory the call returns only once the copy is done, and the
            # copy waits for everything queued on the stream before it.
            _check(driver.cuMemcpyDtoHAsync(array.ctypes.data, int(self._buffers[name].handle), array.nbytes,
                                            self._stream.handle))
        return array

    def size(self, names: Sequence[str]) -> int:
        """Bytes allocated on the device for the named buffers."""
        return sum(self._buffers[name].size for name in names if name in self._buffers)

    def close(self) -> None:
        for buffer in self._buffers.values():
            buffer.close(self._stream)
        self._buffers.clear()
        self._stream.sync()


class CudaBackend:
    """Ranks batches on the GPU against a device mirror of an `InventoryIndex`."""

    name = "cuda"

    def __init__(self, index: IndexReader, device_id: int = 0) -> None:
        reason = device_unavailable_reason()
        if reason is not None:
            raise CudaUnavailable(reason)
        self.index = index
        self.stream = None
        self._arrays = None
        self._generation: int | None = None
        self._shapes: tuple[int, ...] | None = None
        try:
            self._start(device_id)
        except Exception as error:
            # Whatever the driver, NVRTC or cuda.core raise, `auto` must be able to fall
            # back to cpu at startup instead of failing every request later.
            self.close()
            if isinstance(error, CudaUnavailable):
                raise
            raise CudaUnavailable(f"the cuda backend could not start: {type(error).__name__}: {error}") from error

    def _start(self, device_id: int) -> None:
        from cuda.core import Device

        self.device = Device(device_id)
        self.device.set_current()
        major, minor = self.device.compute_capability
        self.arch = f"sm_{major}{minor}"
        module = _compiled(self.arch)
        self._kernels = {name: module.get_kernel(name) for name in KERNEL_NAMES}
        self.stream = self.device.create_stream()
        self._arrays = _DeviceArrays(self.device, self.stream)
        self.index.track_dirty = True
        self._self_check()

    def _self_check(self) -> None:
        """Rank a probe request on the device and on cpu; any difference stops the backend at startup."""
        from kvledger.decide.ranking.cpu import CpuBackend

        probe = [ReuseRequest("kvledger-cuda-self-check", (1, 2, 3, 4), 16, None),
                 ReuseRequest("kvledger-cuda-self-check-2", (), 16, None)]
        settings = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
                                 transfer_source_lookup_budget_ms=1e9)
        answers = [attrs.evolve(answer, backend="cpu") for answer in self.decide_batch(probe, settings)]
        expected = CpuBackend(self.index).decide_batch(probe, settings)
        if answers != expected:
            raise CudaUnavailable(f"self-check: the device answered {answers!r}, cpu {expected!r}")

    def use_index(self, index: IndexReader) -> None:
        """Mirror another index: the next sync uploads it whole (its generation says nothing about the device copy)."""
        self.index = index
        index.track_dirty = True
        self._generation = self._shapes = None

    def close(self) -> None:
        if self._arrays is not None:
            self._arrays.close()
            self._arrays = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def __enter__(self) -> CudaBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def table_device_bytes(self) -> int:
        """Device bytes holding the index: the hash table and every row's bitmasks (buffers
        grow by doubling, so this is what is allocated, not only what is used)."""
        return self._arrays.size(("table_keys", "table_rows", "masks"))

    # --- keeping the device table current --------------------------------------------------

    def sync_table(self) -> None:
        """Upload the whole table after a reallocation, else scatter only what changed."""
        index = self.index
        shapes = (index.table_keys.size, index.holders.shape[0], index.words)
        slots, rows = index.take_dirty()
        if self._generation != index.generation or self._shapes != shapes:
            self._arrays.upload("table_keys", index.table_keys)
            self._arrays.upload("table_rows", index.table_rows)
            self._arrays.upload("masks", index.dense_rows())  # the device keeps every row as bitmasks
            self._generation, self._shapes = index.generation, shapes
            return
        self._scatter_table(slots)
        self._scatter_rows(rows)

    def _launch(self, name: str, grid: int, block: int, *args: object) -> None:
        from cuda.core import LaunchConfig, launch

        launch(self.stream, LaunchConfig(grid=grid, block=block), self._kernels[name], *args)

    def _scatter_table(self, slots: np.ndarray) -> None:
        if not slots.size:
            return
        index = self.index
        positions = self._arrays.upload("dirty_positions", slots.astype(np.int64))
        keys = self._arrays.upload("dirty_keys", index.table_keys[slots])
        rows = self._arrays.upload("dirty_table_rows", index.table_rows[slots])
        self._launch(
            "scatter_table", (slots.size + SCATTER_THREADS - 1) // SCATTER_THREADS, SCATTER_THREADS,
            self._arrays.get("table_keys", 0), self._arrays.get("table_rows", 0), positions, keys, rows,
            np.int32(slots.size),
        )

    def _scatter_rows(self, rows: np.ndarray) -> None:
        if not rows.size:
            return
        index = self.index
        row_words = len(CLASSES) * index.words
        row_ids = self._arrays.upload("dirty_rows", rows.astype(np.int64))
        values = self._arrays.upload("dirty_values", index.dense_rows(rows).reshape(-1))
        total = rows.size * row_words
        self._launch(
            "scatter_rows", (total + SCATTER_THREADS - 1) // SCATTER_THREADS, SCATTER_THREADS,
            self._arrays.get("masks", 0), row_ids, values, np.int32(rows.size), np.int32(row_words),
        )

    # --- ranking -------------------------------------------------------------------------------

    def warm_up(self, settings: ReuseSettings) -> None:
        """Run every code path once before the service reports ready."""
        self.answer_texts([WARM_UP_REQUEST], settings)

    def answer_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerBatch:
        """The batch's answers as arrays; the service encodes them straight to JSON."""
        started = clock()
        ranked = self.rank_batch(requests, settings, clock=clock, started=started)
        return AnswerBatch.of(self.index, requests, ranked, settings, self.name)

    def answer_texts(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerTexts:
        """What the service sends and records, from the ranked arrays."""
        return AnswerTexts.of(self.answer_batch(requests, settings, clock=clock))

    def decide_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> list[Decision]:
        return self.answer_batch(requests, settings, clock=clock).decisions()

    def decide(self, request: ReuseRequest, settings: ReuseSettings, *, clock: Clock = time.perf_counter) -> Decision:
        return self.decide_batch([request], settings, clock=clock)[0]

    def rank_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *,
        clock: Clock = time.perf_counter, started: float | None = None,
    ) -> RankedBatch:
        """One launch of rank_requests for the whole batch; see `decide.ranking.ranked.RankedBatch`."""
        if started is None:
            started = clock()
        self.sync_table()
        index, arrays = self.index, self._arrays
        count, workers = len(requests), index.worker_count
        flat, offsets = sequence_hashes_of(requests)
        target, named = requested_targets(index, requests)
        block_sizes = np.fromiter((r.block_size for r in requests), dtype=np.int32, count=count)
        tiers = source_tier_codes(settings)
        tier_flags = sum(1 << tier for tier in tiers)
        # One launch scans every worker, so the budget is checked once, before it; a batch
        # shares one clock and gets the per-request budget times its size (as cpu does).
        budget_ms = settings.transfer_source_lookup_budget_ms * max(count, 1)
        # With no worker there is nothing to scan, and the reference never reads its clock.
        scan = workers == 0 or (clock() - started) * 1000.0 <= budget_ms
        capacity = max(count * 3 * workers, 1)

        args = (
            arrays.get("table_keys", 0), arrays.get("table_rows", 0), np.int32(index.table_bits),
            arrays.get("masks", 0), np.int32(index.words),
            arrays.upload("hashes", flat), arrays.upload("offsets", offsets), np.int32(count),
            arrays.upload("given_target", target), arrays.upload("named", named.astype(np.uint8)),
            arrays.upload("block_sizes", block_sizes),
            arrays.upload("order_rank", index.order_rank), np.int32(workers),
            np.float64(settings.device_credit_weight), np.float64(settings.host_credit_weight),
            np.float64(settings.disk_credit_weight),
            np.int32(tier_flags), np.int32(1 if scan else 0), np.int32(min(settings.minimum_transfer_prefix_blocks, INT32_MAX)),
            np.float64(settings.minimum_estimated_ttft_saving_ms),
            np.float64(settings.transfer_source_prefill_token_us),
            np.float64(settings.transfer_source_estimated_block_us),
            np.float64(settings.transfer_source_gpu_estimated_block_us),
            arrays.get("block_rows", 4 * flat.size), arrays.get("credits", 8 * count * workers),
            arrays.get("lengths", 4 * count * PREFIX_CLASSES * workers), arrays.get("target_out", 4 * count),
            arrays.get("credited_out", 8 * count), arrays.get("baseline_out", 4 * count),
            arrays.get("reason_out", count),
            *(arrays.get(f"scratch_{name}", 4 * capacity) for name in ("slot", "tier", "prefix", "transfer")),
            *(arrays.get(f"scratch_{name}", 8 * capacity) for name in ("recompute", "transfer_ms", "saving")),
            arrays.upload("total", np.zeros(1, dtype=np.int32)),
            *(arrays.get(f"out_{name}", 4 * capacity) for name in ("request", "slot", "tier", "prefix", "transfer")),
            *(arrays.get(f"out_{name}", 8 * capacity) for name in ("recompute", "transfer_ms", "saving")),
        )
        if count:
            self._launch("rank_requests", count, RANK_THREADS, *args)
        self.stream.sync()

        lengths = arrays.download("lengths", np.int32, count * PREFIX_CLASSES * workers)
        total = int(arrays.download("total", np.int32, 1)[0]) if count else 0
        columns = [arrays.download(f"out_{name}", np.int32, total)
                   for name in ("request", "slot", "tier", "prefix", "transfer")]
        columns += [arrays.download(f"out_{name}", np.float64, total) for name in ("recompute", "transfer_ms", "saving")]
        # Requests append their ranked runs in whatever order their blocks finished.
        order = np.argsort(columns[0], kind="stable")
        columns = [column[order] for column in columns]
        target_out = arrays.download("target_out", np.int32, count)
        overlap_bounds, overlap_slot, overlap_lengths = overlaps_of(
            lengths.reshape(count, PREFIX_CLASSES, workers), target_out, index.slots_in_order, index.order_rank)
        return RankedBatch(
            target_out,
            arrays.download("credited_out", np.float64, count),
            arrays.download("baseline_out", np.int32, count),
            arrays.download("reason_out", np.int8, count),
            overlap_bounds, overlap_slot, overlap_lengths,
            np.searchsorted(columns[0], np.arange(count + 1)).astype(np.int64),
            *columns[1:],
            sequence=flat, sequence_offsets=offsets,
        )
