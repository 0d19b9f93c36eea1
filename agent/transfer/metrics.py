"""Prometheus metrics of the transfer engine (process-wide: every engine in a process shares them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from daybreak.api import metrics as names

REQUESTS = Counter("daybreak_transfer_requests", "Transfer requests finished, by transport, op and status",
                   ["transport", "op", "status"])
BYTES = Counter("daybreak_transfer_bytes", "Bytes moved by completed requests", ["transport", "op"])
FALLBACKS = Counter("daybreak_transfer_fallbacks", "Requests moved to the next transport of their chain",
                    ["from_transport", "to_transport"])
RETRIES = Counter("daybreak_transfer_slice_retries", "Slices sent again after a connection or NIC failure",
                  ["transport"])
PATH_TRIPS = Counter("daybreak_transfer_path_trips", "Paths tripped by the circuit breaker", ["transport"])
PATH_RECOVERIES = Counter("daybreak_transfer_path_recoveries", "Tripped paths that worked again", ["transport"])
PATHS_OPEN = Gauge("daybreak_transfer_paths_tripped", "Paths currently tripped", ["transport"])
FALLBACK_BYTES = Counter(names.TRANSFER_FALLBACK_BYTES,
                         "Bytes of completed requests that a later transport of their chain moved, not the "
                         "preferred (first) one: silent fallback made visible", ["preferred", "used"])
FALLBACK_REASONS = Counter(names.TRANSFER_FALLBACK_REASONS,
                           "Requests that completed on a later path than their first, by why they left it",
                           ["preferred", "used", "reason"])
STAGED_BYTES = Counter(names.TRANSFER_STAGED_BYTES,
                       "Device bytes staged through pinned host memory (tcp; rdma without GPUDirect)", ["transport"])

# Why a request left a path (the ``reason`` label): bounded, so the label stays cheap.
PATH_FAILED = "path_failed"  # the transport reported a failure (connection, NIC, runtime copy)
TRIPPED = "tripped"  # the circuit breaker holds the path open after repeated failures
UNSUPPORTED = "unsupported"  # the transport cannot carry this request (no IPC handle, nothing mappable)
STAGING_FAILED = "staging_failed"  # the device-to-host copy into staging failed
