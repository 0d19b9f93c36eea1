"""The client library inference engines call to put and get KV blocks in a pool.

>>> from daybreak.client import KVPoolClient, block_hashes
>>> c = KVPoolClient(endpoints=["127.0.0.1:7480"], token=token, namespace="ns")   # doctest: +SKIP
>>> keys = block_hashes(prompt_tokens, block_tokens=16)                          # doctest: +SKIP
>>> c.batch_put(keys, buffers)          # copies written per key                 # doctest: +SKIP
>>> c.batch_get_into(keys, buffers)     # sizes in bytes, None for a miss        # doctest: +SKIP
>>> c.close()                                                                    # doctest: +SKIP

Buffers are anything exporting the buffer protocol (bytes, bytearray,
memoryview, mmap, C-contiguous numpy arrays); reads land directly in them.
"""

from daybreak.client.aio import AsyncKVPoolClient
from daybreak.client.env import POOL_TLS_CA_ENV, pool_tls_ca_file
from daybreak.client.hashing import block_hashes
from daybreak.client.pool import KVPoolAuthorizationError, KVPoolClient, KVPoolError, KVPoolQuotaError

__all__ = ["POOL_TLS_CA_ENV", "AsyncKVPoolClient", "KVPoolAuthorizationError", "KVPoolClient", "KVPoolError",
           "KVPoolQuotaError", "block_hashes", "pool_tls_ca_file"]
