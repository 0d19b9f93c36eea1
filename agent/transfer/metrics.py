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
