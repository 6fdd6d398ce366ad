"""The second tier's bytes: the model runner's side of KV offload (the index is the block
manager's, engine/kv_offload/index.py).

A slot holds one block of every layer, as opaque bytes of each layer's cache dtype (whatever
--kv-cache-dtype made them), layer after layer. A layer's cache is [2, Hkv, num_blocks, bs, row]:

    cache[:, :, b]  = [2, Hkv, bs, row]                       one block of one layer
    slot s (bytes)  = [ layer 0's block | layer 1's block | ... | layer L-1's block ]
    store           = [num_slots, slot_bytes] uint8

On CPU the store is one file, allocated whole at start (posix_fallocate: a full disk shows now,
not as SIGBUS later), mapped and unlinked at once (nothing is left behind, even after a crash).
On CUDA it is pinned host memory: a save gathers the blocks on the device (one index_select
per layer) and copies them to the host on a side stream, which overlaps the step's forward; a
restore copies to the device on that stream, which the forward waits for.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time

import torch

from engine.distributed.state import TPShard, all_reduce_min

log = logging.getLogger("pagedserve.engine")


class KVOffloadStore:
    """Slots of whole blocks in host memory (`host`: [num_slots, slot_bytes] uint8)."""

    def __init__(self, kv_caches: list[torch.Tensor], host: torch.Tensor, where: str) -> None:
        self.host = host
        self.num_slots = host.shape[0]
        self.where = where
        self.layers = _layer_spans(kv_caches)  # (byte offset, bytes) of each layer in a slot
        self.saved_bytes = 0  # totals since start, for metrics
        self.restored_bytes = 0
        self.restore_s = 0.0
        self.failed = False  # a save failed: the tier is off from here on (the engine drops the index)
        self._mapping = None  # the file's mmap, kept open for the life of the store

    @property
    def slot_bytes(self) -> int:
        return self.host.shape[1]

    def copy(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
             restores: list[tuple[int, int]]) -> None:
        """This step's (block_id, slot) saves, then (slot, block_id) restores, before its forward.
        A slot saved in this same step is restored from its block, still intact on the device."""
        if saves and not self.failed:
            try:
                self._save(kv_caches, saves)
                self.saved_bytes += len(saves) * self.slot_bytes
            except (OSError, RuntimeError) as e:  # the tier turns off; the engine forgets its index
                log.error("kv offload: saving %d blocks to %s failed (%s); the second tier is off from here on",
                          len(saves), self.where, e)
                self.failed = True
        if not restores:
            return
        start = time.perf_counter()
        just_saved = {slot: block for block, slot in saves}
        direct = [(just_saved[s], b) for s, b in restores if s in just_saved]
        if direct:
            _copy_blocks(kv_caches, direct)
        stored = [(s, b) for s, b in restores if s not in just_saved]
        if stored:
            if self.failed:  # never reached: the index is dropped before another step is scheduled
                raise RuntimeError("kv offload: a restore from a store whose saves failed")
            self._restore(kv_caches, stored)
        self.restored_bytes += len(restores) * self.slot_bytes
        self.restore_s += time.perf_counter() - start

    def _save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        ids = torch.tensor([b for b, _ in saves], device=kv_caches[0].device)
        slots = torch.tensor([s for _, s in saves])
        self.host.index_copy_(0, slots, _gather(kv_caches, ids))

    def _restore(self, kv_caches: list[torch.Tensor], restores: list[tuple[int, int]]) -> None:
        rows = self.host.index_select(0, torch.tensor([s for s, _ in restores]))
        _scatter(kv_caches, torch.tensor([b for _, b in restores]), rows, self.layers)

    def release_pages(self) -> None:
        """Give the saved blocks' memory back (a sleep, which forgets the index): the file's
        pages leave this process's RSS; the mapping stays for the blocks saved after the wake.
        Pinned memory (CUDA) stays pinned: it is host memory, which a sleep keeps."""
        if self._mapping is not None:
            self._mapping.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.host = torch.empty(0, 0, dtype=torch.uint8)
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None


class CudaOffloadStore(KVOffloadStore):
    """Pinned host memory; device<->host copies on a side stream."""

    def __init__(self, kv_caches: list[torch.Tensor], host: torch.Tensor) -> None:
        super().__init__(kv_caches, host, "pinned host memory")
        self.stream = torch.cuda.Stream(device=kv_caches[0].device)

    def _save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        device = kv_caches[0].device
        staging = _gather(kv_caches, torch.tensor([b for b, _ in saves], device=device))
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the gather is done first
        with torch.cuda.stream(self.stream):  # overlaps the forward, which never reads staging
            for i, (_, slot) in enumerate(saves):
                self.host[slot].copy_(staging[i], non_blocking=True)
        staging.record_stream(self.stream)

    def _restore(self, kv_caches: list[torch.Tensor], restores: list[tuple[int, int]]) -> None:
        device = kv_caches[0].device
        main = torch.cuda.current_stream(device)
        self.stream.wait_stream(main)  # after this step's gathers, which may read the same blocks
        with torch.cuda.stream(self.stream):  # after earlier saves' copies to the host, in stream order
            rows = torch.empty((len(restores), self.slot_bytes), dtype=torch.uint8, device=device)
            for i, (slot, _) in enumerate(restores):
                rows[i].copy_(self.host[slot], non_blocking=True)
        main.wait_stream(self.stream)
        rows.record_stream(main)
        _scatter(kv_caches, torch.tensor([b for _, b in restores], device=device), rows, self.layers)
        main.synchronize()  # restore_s is the time until the blocks are there


def open_offload(config, kv_caches: list[torch.Tensor], shard: TPShard) -> KVOffloadStore | None:
    """The model runner's store where the config asks for one (`--kv-offload-gb` or
    `--kv-offload-dir`), else None. Every tensor-parallel rank opens its own, with the same
    slots (rank 0 broadcasts the copies with the step): the fewest any rank could hold."""
    if config.kv_offload_gb is None or not config.enable_prefix_caching:
        return None
    store = open_store(kv_caches, config.kv_offload_gb, config.kv_offload_dir, shard.rank)
    num_slots = all_reduce_min(0 if store is None else store.num_slots, shard)
    if store is not None and num_slots < store.num_slots:  # another rank has fewer (or none): use as many
        store.host = store.host[:num_slots]
        store.num_slots = num_slots
    if store is not None and num_slots == 0:
        store.close()
        return None
    return store


def open_store(kv_caches: list[torch.Tensor], size_gb: float, directory: str | None,
               rank: int = 0) -> KVOffloadStore | None:
    """The second tier for these caches, or None (with one log line) where it cannot be had:
    a slot bigger than the size, an unwritable directory, a full disk, no pinned memory."""
    slot_bytes = sum(n for _, n in _layer_spans(kv_caches))
    num_slots = int(size_gb * 2**30) // slot_bytes
    if num_slots < 1:
        log.error("kv offload: off: %.3g GiB holds no block of %d bytes (raise --kv-offload-gb)", size_gb, slot_bytes)
        return None
    on_cuda = kv_caches[0].device.type == "cuda"
    try:
        if on_cuda:
            if directory:
                log.warning("kv offload: on cuda the second tier is pinned host memory; --kv-offload-dir is unused")
            host = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=True)
            store = CudaOffloadStore(kv_caches, host)
        else:
            store = _file_store(kv_caches, num_slots, slot_bytes, directory, rank)
    except (OSError, RuntimeError, OverflowError) as e:
        log.error("kv offload: off: cannot hold %d blocks (%.3g GiB) in %s: %s", num_slots,
                  num_slots * slot_bytes / 2**30, "pinned host memory" if on_cuda else directory or "a temp dir", e)
        return None
    log.info("kv offload: %d blocks (%.3g GiB, %d bytes each) in %s", num_slots, num_slots * slot_bytes / 2**30,
             slot_bytes, store.where)
    return store


def _file_store(kv_caches: list[torch.Tensor], num_slots: int, slot_bytes: int, directory: str | None,
                rank: int) -> KVOffloadStore:
    """One file of num_slots x slot_bytes, allocated, mapped and unlinked."""
    made = directory is None
    directory = directory or tempfile.mkdtemp(prefix="pagedserve-kv-offload-")
    path = os.path.join(directory, f"kv-offload-{os.getpid()}-rank{rank}.bin")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, num_slots * slot_bytes)
            mapping = mmap.mmap(fd, num_slots * slot_bytes)
        finally:
            os.close(fd)
            if os.path.exists(path):
                os.unlink(path)
    finally:
        if made:
            os.rmdir(directory)
    host = torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)
    store = KVOffloadStore(kv_caches, host, f"{directory} (a file of {num_slots * slot_bytes} bytes, unlinked)")
    store._mapping = mapping
    return store


def _layer_spans(kv_caches: list[torch.Tensor]) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for cache in kv_caches:
        size = cache[:, :, 0].numel() * cache.element_size()
        spans.append((offset, size))
        offset += size
    return spans


def _gather(kv_caches: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` of every layer as [n, slot_bytes] uint8 rows, on the caches' device."""
    n = len(ids)
    return torch.cat([_bytes(c).index_select(2, ids).movedim(2, 0).reshape(n, -1) for c in kv_caches], dim=1)


def _scatter(kv_caches: list[torch.Tensor], ids: torch.Tensor, rows: torch.Tensor,
             spans: list[tuple[int, int]]) -> None:
    """The inverse of _gather: rows [n, slot_bytes] into blocks `ids` of every layer."""
    n = len(ids)
    rows = rows.to(kv_caches[0].device)
    for cache, (offset, size) in zip(map(_bytes, kv_caches), spans):
        part = rows[:, offset:offset + size].reshape(n, cache.shape[0], cache.shape[1], *cache.shape[3:])
        cache.index_copy_(2, ids, part.movedim(0, 2))


def _copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    src = torch.tensor([s for s, _ in pairs], device=kv_caches[0].device)
    dst = torch.tensor([d for _, d in pairs], device=kv_caches[0].device)
    for cache in map(_bytes, kv_caches):
        cache.index_copy_(2, dst, cache.index_select(2, src))


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as bytes, [2, Hkv, num_blocks, block_size, row x itemsize] uint8: every copy here
    moves bytes, whatever the dtype (CPU torch has no index_copy_ for fp8)."""
    return cache.view(torch.uint8)
