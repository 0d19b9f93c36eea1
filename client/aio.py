"""``AsyncKVPoolClient``: the asyncio face of ``KVPoolClient``.

Each call runs the synchronous client in one dedicated worker thread, so the
event loop never blocks on a socket or a memcpy; the copies themselves
release the GIL. Calls on one client are serialised (the connections behind
it carry one request at a time); open several clients for parallel streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from daybreak.client.pool import KVPoolClient

T = TypeVar("T")


class AsyncKVPoolClient:
    """Same arguments and methods as ``KVPoolClient``, awaited. Create it with ``await AsyncKVPoolClient.connect(...)``."""

    def __init__(self, client: KVPoolClient, executor: concurrent.futures.ThreadPoolExecutor) -> None:
        self._client = client
        self._executor = executor

    @classmethod
    async def connect(cls, endpoints: Sequence[str], *, token: str, namespace: str, replicas: int | None = None,
                      transport: Literal["auto", "tcp"] = "auto", timeout_seconds: float = 30.0,
                      verify: bool = True, local_first: bool = True,
                      tls_ca_file: str | None = None,
                      transports: Sequence[str] | None = None) -> AsyncKVPoolClient:
        """Connect to the pool (see ``KVPoolClient`` for the arguments)."""
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool")
        make = functools.partial(KVPoolClient, endpoints, token=token, namespace=namespace, replicas=replicas,
                                 transport=transport, timeout_seconds=timeout_seconds, verify=verify,
                                 local_first=local_first, tls_ca_file=tls_ca_file, transports=transports)
        try:
            client = await asyncio.get_running_loop().run_in_executor(executor, make)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(client, executor)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def batch_put(self, keys: Sequence[str], buffers: Sequence[Any], *, pin_seconds: int = 0,
                        tier: Literal["dram", "hbm"] = "dram") -> list[int]:
        """See ``KVPoolClient.batch_put``: copies written per key."""
        result: list[int] = await self._run(self._client.batch_put, keys, buffers, pin_seconds=pin_seconds,
                                            tier=tier)
        return result

    async def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """See ``KVPoolClient.batch_get_into``: block sizes in bytes, None on a miss."""
        result: list[int | None] = await self._run(self._client.batch_get_into, keys, buffers)
        return result

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """See ``KVPoolClient.batch_exists``."""
        result: list[bool] = await self._run(self._client.batch_exists, keys)
        return result

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        """See ``KVPoolClient.remove``."""
        result: list[bool] = await self._run(self._client.remove, keys)
        return result

    async def close(self) -> None:
        """Close the connections and stop the worker thread."""
        await self._run(self._client.close)
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> AsyncKVPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
