"""The demo's summary: the JSON ``DEMO_JSON`` gets and the table printed at the end.

Built on ``daybreak.serving.load.summary.summarize`` (TTFT percentiles, hit rate,
failures over every request of both streams), plus what the cluster reported:
block bytes moved per transport as the agents counted them where the bytes
moved (``daybreak_store_bytes_total{transport,op}``: engine KV and the agents'
own copies to each other; the demo pool allows tcp only), the engines' own KV
bytes (``daybreak_engine_kv_bytes_total``) beside it, the planner's scale
events, and the agent kill.
"""

from __future__ import annotations

import time
from typing import Any

from daybreak.devenv.demo.live import Sampler
from daybreak.devenv.demo.workload import Workload, trace_reuse
from daybreak.serving.load.summary import summarize


def build(workload: Workload, sampler: Sampler, *, killed_agent: str | None) -> dict[str, Any]:
    """Everything the demo measured, as one JSON-ready dict."""
    records = workload.records
    out = summarize(records, duration_s=workload.elapsed())
    by_kind = {kind: summarize([r for r, k in zip(records, workload.kinds, strict=True) if k == kind],
                               duration_s=workload.elapsed()) for kind in ("session", "trace")}
    engines = sampler.bytes_moved()
    by_transport = sampler.bytes_by_transport()
    out.update(
        bytes_moved={t: int(v["read"] + v["written"]) for t, v in sorted(by_transport.items())},
        bytes_moved_by_direction={t: {"read": int(v["read"]), "written": int(v["written"])}
                                  for t, v in sorted(by_transport.items())},
        engine_kv_bytes={"read": int(engines["read"]), "written": int(engines["written"])},
        scale_events=[e.as_dict() for e in sampler.scale_events],
        killed_agent=killed_agent,
        streams={kind: {k: s[k] for k in ("requests", "failed_requests", "ttft_p50_s", "ttft_p90_s", "hit_rate")}
                 for kind, s in by_kind.items()},
        trace_slice_reuse=trace_reuse(workload.sent_blocks),
        seconds=workload.seconds,
        timeline=[{"at_s": at, "what": what} for at, what in sampler.marks],
        # wall clock of t=0 above (phases, scale events): what Prometheus's samples line up against
        load_started_unix=round(time.time() - workload.elapsed(), 3),
    )
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a few aligned lines."""
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    def pct(v: Any) -> str:
        return "-" if v is None else f"{v:.1%}"

    ups = sum(1 for e in summary["scale_events"] if e["to"] > e["from"])
    downs = sum(1 for e in summary["scale_events"] if e["to"] < e["from"])
    rows = [
        ("requests", f"{summary['requests']} ({summary['failed_requests']} failed)"),
        ("TTFT p50 / p90", f"{ms(summary['ttft_p50_s'])} / {ms(summary['ttft_p90_s'])}"),
        ("hit rate", f"{pct(summary['hit_rate'])} (trace slice alone: {pct(summary['streams']['trace']['hit_rate'])}"
                     f", its unbounded-cache reuse {pct(summary['trace_slice_reuse'])})"),
        *[(f"bytes moved ({t})", f"{v / 1e6:.1f} MB (read {d['read'] / 1e6:.1f}, written {d['written'] / 1e6:.1f};"
                                 " agents' counters)")
          for (t, v), d in zip(summary["bytes_moved"].items(), summary["bytes_moved_by_direction"].values(),
                               strict=True)],
        ("engines' KV bytes", f"read {summary['engine_kv_bytes']['read'] / 1e6:.1f} MB, written "
                              f"{summary['engine_kv_bytes']['written'] / 1e6:.1f} MB (1 KiB blocks of 16 tokens)"),
        ("scale events", f"{len(summary['scale_events'])} ({ups} up, {downs} down)"),
        *[("", f"{e['role']} {e['from']} -> {e['to']} at {e['at_s']:.0f}s") for e in summary["scale_events"]],
        ("agent killed", summary["killed_agent"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
