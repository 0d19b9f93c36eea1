"""The simulated engine's KV: its engine-local prefix cache (keys only) and the real block I/O to the pool.

Every block the engine "computes" is written to the pool with the bytes
``serving.prompt.block_content`` defines for (kvNamespace, key), and every
block it reads back is compared byte for byte with those bytes, so a wrong,
stale or foreign block is caught and recomputed, never served as good.

Block I/O runs in worker threads (``KVPoolClient`` is blocking); each worker
owns one client and one set of preallocated block buffers that reads land in
and writes are filled from, so steady state allocates nothing per block.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from daybreak.client import KVPoolClient, KVPoolError

log = logging.getLogger(__name__)

T = TypeVar("T")

_PATTERN_BYTES = 64  # must match serving.prompt.block_content (tests check they agree)


def fill_block(buffer: bytearray, *, namespace: str, key: str) -> None:
    """Write ``block_content(namespace, key, len(buffer))`` into ``buffer`` in place (log2 memcpys)."""
    pattern = hashlib.blake2b(f"{namespace}\0{key}".encode(), digest_size=_PATTERN_BYTES).digest()
    view = memoryview(buffer)
    size = len(buffer)
    head = min(size, _PATTERN_BYTES)
    view[:head] = pattern[:head]
    done = head
    while done < size:
        step = min(done, size - done)
        view[done:done + step] = view[:step]
        done += step


class LocalCache:
    """The engine-local prefix cache: an LRU of block keys (the bytes live in the pool, or nowhere).

    It stands for the blocks an engine keeps in its own accelerator memory; with ``--no-pool``
    it is the only cache there is.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"local cache capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._keys: OrderedDict[str, None] = OrderedDict()
        # Cached blocks the pool is not known to hold (computed by a decode engine, or a failed write):
        # the cache value a scale-in would lose, and what a draining engine hands to the pool.
        self._unpooled: set[str] = set()

    def __len__(self) -> int:
        return len(self._keys)

    def prefix(self, keys: Sequence[str], *, touch: bool = True) -> int:
        """How many leading ``keys`` are cached; ``touch`` marks them recently used."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        if touch:
            for key in keys[:n]:
                self._keys.move_to_end(key)
        return n

    def insert(self, keys: Sequence[str]) -> None:
        """Cache ``keys`` (most recently used last), evicting the least recently used beyond capacity."""
        if not self.capacity:
            return
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            evicted, _ = self._keys.popitem(last=False)
            self._unpooled.discard(evicted)

    def mark_unpooled(self, keys: Sequence[str]) -> None:
        """These cached keys are not (known to be) in the pool."""
        self._unpooled.update(k for k in keys if k in self._keys)

    def mark_pooled(self, keys: Sequence[str]) -> None:
        """These keys are in the pool now."""
        self._unpooled.difference_update(keys)

    @property
    def local_only(self) -> int:
        """Cached blocks the pool is not known to hold."""
        return len(self._unpooled)

    def unpooled(self) -> list[str]:
        """The cached keys the pool is not known to hold, most recently used first (hottest first)."""
        return [k for k in reversed(self._keys) if k in self._unpooled]


@dataclass
class ReadResult:
    """What reading a run of blocks from the pool found: ``good`` leading blocks are usable."""

    good: int = 0
    checked: int = 0
    corrupt: list[int] = field(default_factory=list)  # indices (into the keys read) that failed the check
    bytes_read: int = 0


@dataclass
class _Worker:
    client: KVPoolClient
    buffers: list[bytearray]
    expected: bytearray


class PoolIO:
    """Block reads and writes of one engine against its pool, ``workers`` at a time.

    ``block_bytes``: the size of every block this engine writes and accepts. ``batch_blocks``:
    blocks per client call (and buffers per worker). ``connect`` makes one client (tests and the
    CLI pass a factory so endpoints and tokens stay in one place).
    """

    def __init__(self, *, connect: Callable[[], KVPoolClient], namespace: str, block_bytes: int,
                 workers: int = 4, batch_blocks: int = 16) -> None:
        if block_bytes < 1:
            raise ValueError(f"block bytes must be positive, got {block_bytes}")
        self.namespace = namespace
        self.block_bytes = block_bytes
        self._connect = connect
        self._batch = max(1, batch_blocks)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvio")
        self._count = workers
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._made = 0
        self._lock = asyncio.Lock()
        self.background: asyncio.Task[None] | None = None
        """A task that lives as long as this pool (the endpoint refresher); cancelled on close."""

    async def start(self) -> None:
        """Connect the first worker's client (raises KVPoolError when no agent answers)."""
        worker = await self._make()
        self._idle.put_nowait(worker)

    async def _make(self) -> _Worker:
        client = await asyncio.get_running_loop().run_in_executor(self._executor, self._connect)
        self._made += 1
        return _Worker(client, [bytearray(self.block_bytes) for _ in range(self._batch)],
                       bytearray(self.block_bytes))

    async def _run(self, fn: Callable[[_Worker], T]) -> T:
        worker: _Worker | None = None
        async with self._lock:
            if self._idle.empty() and self._made < self._count:
                worker = await self._make()
        if worker is None:
            worker = await self._idle.get()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, worker)
        except KVPoolError:
            # The client reaches no agent any more: drop it, so the next call connects afresh
            # (to the endpoints as they are then, e.g. re-read from the KVPool's status).
            self._made -= 1
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(self._executor, worker.client.close)
            worker = None
            raise
        finally:
            if worker is not None:
                self._idle.put_nowait(worker)

    def exists(self, keys: Sequence[str]) -> Awaitable[list[bool]]:
        """Which keys the pool holds (all of them asked at once)."""
        return self._run(lambda w: w.client.batch_exists(keys) if keys else [])

    def _parts(self, keys: Sequence[str]) -> list[Sequence[str]]:
        """``keys`` cut into contiguous runs, one per worker, each at least one client batch long."""
        per = max(self._batch, -(-len(keys) // self._count))
        return [keys[i:i + per] for i in range(0, len(keys), per)]

    async def read_prefix(self, keys: Sequence[str]) -> ReadResult:
        """Read ``keys``, checking each block's bytes; ``good`` is the run of usable blocks from the start.

        Long runs are read by several workers at once; each stops at its first miss or bad block.
        """
        parts = self._parts(keys)
        results = await asyncio.gather(*(self._run(functools.partial(self._read, keys=part)) for part in parts))
        out = ReadResult()
        offset = 0
        prefix_open = True
        for part, result in zip(parts, results, strict=True):
            if prefix_open:
                out.good += result.good
                prefix_open = result.good == len(part)
            out.checked += result.checked
            out.bytes_read += result.bytes_read
            out.corrupt.extend(offset + i for i in result.corrupt)
            offset += len(part)
        return out

    async def write(self, keys: Sequence[str]) -> tuple[int, int]:
        """Write each key's content block (several workers for long runs); returns (blocks stored, bytes sent)."""
        results = await asyncio.gather(*(self._run(functools.partial(self._write, keys=part))
                                         for part in self._parts(keys)))
        return sum(r[0] for r in results), sum(r[1] for r in results)

    def _read(self, worker: _Worker, keys: Sequence[str]) -> ReadResult:
        result = ReadResult()
        for start in range(0, len(keys), self._batch):
            chunk = list(keys[start:start + self._batch])
            buffers = worker.buffers[:len(chunk)]
            try:
                sizes = worker.client.batch_get_into(chunk, buffers)
            except ValueError:
                # A stored block larger than ours: another layout under our namespace. Not our KV.
                result.checked += 1
                result.corrupt.append(start)
                return result
            for j, (key, size) in enumerate(zip(chunk, sizes, strict=True)):
                if size is None:
                    return result
                result.checked += 1
                result.bytes_read += size
                fill_block(worker.expected, namespace=self.namespace, key=key)
                if size != self.block_bytes or buffers[j] != worker.expected:
                    result.corrupt.append(start + j)
                    log.warning("event=kv_block_corrupt key=%s size=%d expected_size=%d action=recompute",
                                key, size, self.block_bytes)
                    return result
                result.good += 1
        return result

    def _write(self, worker: _Worker, keys: Sequence[str]) -> tuple[int, int]:
        stored = sent = 0
        for start in range(0, len(keys), self._batch):
            chunk = list(keys[start:start + self._batch])
            buffers = worker.buffers[:len(chunk)]
            for key, buffer in zip(chunk, buffers, strict=True):
                fill_block(buffer, namespace=self.namespace, key=key)
            copies = worker.client.batch_put(chunk, buffers)
            ok = sum(1 for c in copies if c > 0)
            stored += ok
            sent += ok * self.block_bytes
        return stored, sent

    async def close(self) -> None:
        """Close every client and stop the worker threads."""
        if self.background is not None:
            self.background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.background
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(self._executor, worker.client.close)
        self._executor.shutdown(wait=False, cancel_futures=True)


async def timed(awaitable: Awaitable[T]) -> tuple[T, float]:
    """``(result, seconds it took)``."""
    start = time.monotonic()
    result = await awaitable
    return result, time.monotonic() - start


__all__ = ["KVPoolError", "LocalCache", "PoolIO", "ReadResult", "fill_block", "timed"]
