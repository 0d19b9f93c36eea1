"""The load generator's pure parts: the trace parser, percentiles and the summary, rate steps, the LRU bound."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from daybreak.serving.load.lru import lru_bound
from daybreak.serving.load.sessions import Session, parse_steps, rate_at
from daybreak.serving.load.summary import RequestRecord, percentile, summarize
from daybreak.serving.load.trace import (
    SYNTHETIC_TRACE,
    TRACES_DIR,
    TraceError,
    TraceRequest,
    parse_line,
    read_trace,
    sample_by_root,
)
from daybreak.serving.prompt import parse_prompt, render_chat, tokenize


def test_trace_lines_parse_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    req = parse_line('{"timestamp": 40, "input_length": 1030, "output_length": 3, "hash_ids": [1, 2, 3]}')
    assert req == TraceRequest(40.0, 1030, 3, (1, 2, 3))
    body = req.body(model="m")
    assert body["max_tokens"] == 3 and body["stream_options"] == {"include_usage": True}
    assert len(parse_prompt(body).tokens) == 1030
    for line, field in [('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
                        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
                        ('{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [1]}',
                         "output_length"),
                        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
                        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "hash_ids"),
                        ("[1, 2]", "object"), ("{", "not JSON")]:
        with pytest.raises(TraceError, match=field):
            parse_line(line, where="t.jsonl:7")
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n\n'
                    '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [2]}\n'
                    '{"timestamp": 2, "input_length": 5, "output_length": 1}\n')
    assert len(list(read_trace(path, limit=2))) == 2
    with pytest.raises(TraceError, match=r"t.jsonl:4: hash_ids"):
        list(read_trace(path))


def test_the_synthetic_trace_in_the_repository_parses_whole() -> None:
    reqs = list(read_trace(SYNTHETIC_TRACE))
    assert len(reqs) == 3993
    assert reqs[0].timestamp_ms == 0 and reqs[-1].timestamp_ms > 1_000_000


def test_every_trace_in_the_repository_is_whole_and_its_source_and_licence_are_noted() -> None:
    readme = (TRACES_DIR / "README.md").read_text()
    traces = sorted(p.name for p in TRACES_DIR.iterdir() if p.suffix in (".jsonl", ".csv"))
    assert traces == ["azure_llm_code_2023.csv", "synthetic_trace.jsonl"]
    for name, licence in (("synthetic_trace.jsonl", "Apache-2.0"), ("azure_llm_code_2023.csv", "CC-BY 4.0")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}`"))
        assert licence in row, row
    assert (TRACES_DIR / "LICENSE-Apache-2.0").read_text().lstrip().startswith("Apache License")
    with open(TRACES_DIR / "azure_llm_code_2023.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8819
    assert all(int(r["ContextTokens"]) > 0 and int(r["GeneratedTokens"]) >= 0 for r in rows)


def test_percentiles_interpolate_and_empty_is_null() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2, 5], 90) == pytest.approx(4.6)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summary_counts_failures_and_weights_hit_rate_by_prompt_tokens() -> None:
    a = RequestRecord(sent_at=0, ok=True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.01, 0.03])
    a.take_usage({"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 90},
                  "daybreak": {"pool_hit_tokens": 80, "local_hit_tokens": 10, "bytes_read": 5, "bytes_written": 7}})
    b = RequestRecord(sent_at=0, ok=True, ttft_s=0.3, e2e_s=0.6, itl_s=[0.02])
    b.take_usage({"prompt_tokens": 300, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}})
    c = RequestRecord(sent_at=0, ok=False, error="http_503")
    s = summarize([a, b, c], duration_s=2.0)
    assert (s["requests"], s["completed_requests"], s["failed_requests"]) == (3, 2, 1)
    assert s["errors"] == {"http_503": 1}
    assert s["hit_rate"] == pytest.approx(90 / 400)
    assert s["pool_hit_rate"] == pytest.approx(80 / 400)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["itl_p50_s"] == pytest.approx(0.02)
    assert s["output_tokens_per_s"] == pytest.approx(2.5)
    assert (s["bytes_read"], s["bytes_written"]) == (5, 7)
    json.dumps(s)  # serialisable as is
    empty = summarize([], duration_s=1.0)
    assert empty["ttft_p50_s"] is None and empty["hit_rate"] is None


def test_rate_steps_parse_relative_and_absolute() -> None:
    steps = parse_steps("1x:30s,4x:30s,2.5:10", base_rate=2.0)
    assert [(s.rate, s.seconds) for s in steps] == [(2.0, 30.0), (8.0, 30.0), (2.5, 10.0)]
    assert rate_at(steps, 0) == 2.0 and rate_at(steps, 45) == 8.0 and rate_at(steps, 65) == 2.5
    assert rate_at(steps, 70) is None
    for bad in ("", "4x", "fast:30s", "0x:10s"):
        with pytest.raises(ValueError):
            parse_steps(bad, base_rate=1.0)


def test_a_session_turn_extends_the_previous_prompt() -> None:
    s = Session(index=0, system="S" * 100, seed=1, user_chars=20)
    first = tokenize(render_chat(s.next_body(model="m", max_tokens=4)["messages"]))
    s.answered("the answer")
    second = tokenize(render_chat(s.next_body(model="m", max_tokens=4)["messages"]))
    assert second[:len(first)] == first and len(second) > len(first)
    other = Session(index=1, system="S" * 100, seed=2, user_chars=20)
    third = tokenize(render_chat(other.next_body(model="m", max_tokens=4)["messages"]))
    assert third[:110] == first[:110]  # the shared system prompt


def test_lru_bound_uses_prefix_semantics_and_the_capacity() -> None:
    reqs = [TraceRequest(0, 1536, 1, (1, 2, 3)), TraceRequest(1, 1536, 1, (1, 2, 3)),
            TraceRequest(2, 1536, 1, (9, 2, 3))]
    unbounded = lru_bound(reqs, capacity_blocks=100)
    # Second request hits all 3 blocks; the third shares ids 2, 3 but not its first block: no prefix hit.
    assert (unbounded.hit_blocks, unbounded.blocks) == (3, 9)
    assert unbounded.hit_rate == pytest.approx(3 * 512 / (3 * 1536))
    tiny = lru_bound(reqs, capacity_blocks=2)  # block 1 is evicted by 2, 3 within the first request
    assert tiny.hit_blocks == 0
    assert lru_bound(reqs, capacity_blocks=0).hit_blocks == 0
    # A partial last block is never cached.
    partial = lru_bound([TraceRequest(0, 1000, 1, (5, 6)), TraceRequest(1, 1000, 1, (5, 6))], capacity_blocks=9)
    assert partial.hit_tokens == 512


def test_lru_bound_of_the_synthetic_trace_is_below_the_unbounded_reuse() -> None:
    reqs = list(read_trace(SYNTHETIC_TRACE))
    unbounded = lru_bound(reqs, capacity_blocks=10**9)
    small = lru_bound(reqs, capacity_blocks=2000)
    assert unbounded.hit_rate is not None and small.hit_rate is not None
    assert 0 < small.hit_rate < unbounded.hit_rate < 1


def test_sampling_by_root_block_keeps_prefix_trees_whole() -> None:
    reqs = [TraceRequest(0, 1024, 1, (8, 1)), TraceRequest(1, 1024, 1, (3, 4)), TraceRequest(2, 1536, 1, (8, 1, 2)),
            TraceRequest(3, 512, 1, (16,))]
    assert [r.timestamp_ms for r in sample_by_root(reqs, every=8)] == [0, 2, 3]
    assert sample_by_root(reqs, every=1) == reqs
    full = list(read_trace(SYNTHETIC_TRACE))
    sample = sample_by_root(full, every=8)
    assert len(full) / 12 < len(sample) < len(full) / 5
    reuse = lru_bound(sample, capacity_blocks=10**9).hit_rate
    assert reuse is not None and reuse > 0.5  # the full trace's reuse (64% of blocks) survives the sampling


AZURE_ROWS = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:17:03.9799600,4808,10\n"
              "2023-11-16 18:17:04.0319600,3180,8\n"
              "2023-11-16 18:17:05.0319600,100,2\n"
              "2023-11-16 18:17:06.5319600,600,1\n")


def test_an_azure_csv_trace_gives_prompts_of_its_length_with_blocks_of_their_own(tmp_path: Path) -> None:
    from daybreak.serving.load.trace import trace_format

    path = tmp_path / "azure.csv"
    path.write_text(AZURE_ROWS)
    assert trace_format(path) == "azure"
    reqs = list(read_trace(path))
    assert [r.input_length for r in reqs] == [4808, 3180, 100, 600]
    assert [r.output_length for r in reqs] == [10, 8, 2, 1]
    assert reqs[1].timestamp_ms - reqs[0].timestamp_ms == pytest.approx(52.0, abs=1e-3)
    assert len(parse_prompt(reqs[0].body(model="m")).tokens) == 4808
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(ids) == len(set(ids)) == 10 + 7 + 1 + 2  # no prefix shared between requests
    # --sample 2: every second request, the first kept; the ids each request gets do not depend on sampling.
    sampled = list(read_trace(path, every=2))
    assert [r.input_length for r in sampled] == [4808, 100]
    assert sampled[1].hash_ids == reqs[2].hash_ids
    for bad, field in [("2023-11-16 18:17:03.9799600,abc,10", "ContextTokens"),
                       ("2023-11-16 18:17:03.9799600,10,0", "GeneratedTokens"),
                       ("yesterday,10,1", "TIMESTAMP"), ("2023-11-16 18:17:03.1,10", "3 fields")]:
        path.write_text(AZURE_ROWS + bad + "\n")
        with pytest.raises(TraceError, match=rf"azure.csv:6: .*{field}"):
            list(read_trace(path))


def test_the_shared_azure_trace_parses_whole() -> None:
    path = TRACES_DIR / "azure_llm_code_2023.csv"
    reqs = list(read_trace(path))
    assert len(reqs) == 8819
    assert len(list(read_trace(path, every=10))) == 882


def test_sample_keeps_every_nth_mooncake_request_and_time_scale_compresses_the_replay(tmp_path: Path) -> None:
    """--sample and --time-scale through the replay itself: a stub server records when each request came."""
    import asyncio
    import time as time_mod

    from aiohttp import web

    from daybreak.serving.load import add_arguments, run_load

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 5, "output_length": 1,
                                        "hash_ids": [i]}) + "\n" for i in range(6)))
    seen: list[tuple[float, list[int]]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((time_mod.monotonic(), body["hash_ids"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x", "index": 0}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> dict[str, object]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        import argparse

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["--url", f"http://127.0.0.1:{port}", "--trace", str(path), "--sample", "2",
                                  "--time-scale", "0.01", "--quiet"])
        try:
            return await run_load(args)
        finally:
            await runner.cleanup()

    summary = asyncio.run(main())
    # Every second request; at 2 ms apart two may overtake each other on a busy machine, so not their order.
    assert sorted(ids for _, ids in seen) == [[0], [2], [4]]
    assert summary["sample"] == 2 and summary["time_scale"] == 0.01


def test_token_scale_keeps_leading_blocks_and_busiest_rate_finds_the_burst() -> None:
    from daybreak.serving.load.trace import busiest_rate, scale_tokens

    req = TraceRequest(0.0, 2048, 100, (7, 8, 9, 10))
    small = scale_tokens(req, factor=0.25)
    assert (small.input_length, small.output_length, small.hash_ids) == (512, 25, (7,))
    assert scale_tokens(TraceRequest(0.0, 3, 1, (1,)), factor=0.01).input_length == 1
    times = [0.0, 1.0, 2.0, 60.0, 60.1, 60.2, 60.3, 120.0]
    assert busiest_rate(times, window_s=1.0) == 4.0
    assert busiest_rate(times, window_s=60.0) == pytest.approx(6 / 60)  # 1.0 .. 60.3


def test_shapes_sine_starts_low_and_crests_at_half_period_ramp_climbs_then_holds() -> None:
    from daybreak.serving.load.trace import parse_shape

    sine = parse_shape("sine:1x:4x:60s", base_rate=0.5)
    assert (sine.low, sine.high) == (0.5, 2.0)
    assert sine.rate_at(0) == pytest.approx(0.5) and sine.rate_at(30) == pytest.approx(2.0)
    assert sine.rate_at(15) == pytest.approx(1.25) and sine.rate_at(60) == pytest.approx(0.5)
    ramp = parse_shape("ramp:1:3:20", base_rate=9.0)
    assert [ramp.rate_at(t) for t in (0, 10, 20, 100)] == [1.0, 2.0, 3.0, 3.0]
    assert parse_shape("ramp:4:1:10s", base_rate=1).rate_at(5) == 2.5  # a falling ramp
    for bad in ("sine:0:4:60s", "sine:4:1:60s", "tri:1:2:3s", "sine:1:2:0s"):
        with pytest.raises(ValueError, match="--rate-shape"):
            parse_shape(bad, base_rate=1.0)
