"""The router's pure decisions: which pod, when to skip prefill, what usage the client sees, what a scrape says."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from daybreak.client.discovery import endpoints_from_pool
from daybreak.serving.kube import (
    endpoints_from_pods,
    endpoints_from_slices,
    namespaces_of,
    pod_namespace_index,
)
from daybreak.serving.router.choice import (
    Candidate,
    CostModel,
    in_namespace,
    load_of,
    pool_prefix,
    prefill_cost,
    rank,
    request_namespace,
    skip_prefill,
)
from daybreak.serving.router.discovery import RolePods, parse_load
from daybreak.serving.router.server import Router, RouterConfig, combine_usage

MODEL = CostModel(compute_block_seconds=0.01, load_block_seconds=0.001, queue_seconds=0.05)


def test_least_loaded_pod_wins_when_nothing_is_cached() -> None:
    pods = [Candidate("a:1", load=3), Candidate("b:1", load=1), Candidate("c:1", load=2)]
    assert [c.address for c in rank(pods)] == ["b:1", "c:1", "a:1"]
    assert rank(pods, blocks=100, prefix_aware=True, model=MODEL)[0].address == "b:1"


def test_engine_local_prefix_beyond_the_pool_outweighs_a_little_queue() -> None:
    # The pool holds 10 of 100 blocks; pod a holds 90 locally: 80 blocks less compute (0.8 s) > 2 queued (0.1 s).
    pods = [Candidate("a:1", load=2, local_blocks=90), Candidate("b:1", load=0)]
    assert rank(pods, blocks=100, pool_blocks=10, prefix_aware=True, model=MODEL)[0].address == "a:1"
    # ...but not a long queue: 20 queued requests cost 1 s.
    busy = [Candidate("a:1", load=20, local_blocks=90), Candidate("b:1", load=0)]
    assert rank(busy, blocks=100, pool_blocks=10, prefix_aware=True, model=MODEL)[0].address == "b:1"


def test_local_prefix_the_pool_also_holds_saves_only_the_load_cost() -> None:
    # The pool holds 90 of 100 blocks; pod a holds the same 90 locally: it saves 90 loads (0.09 s) only,
    # less than two queued requests (0.1 s)...
    pods = [Candidate("a:1", load=2, local_blocks=90), Candidate("b:1", load=0)]
    assert rank(pods, blocks=100, pool_blocks=90, prefix_aware=True, model=MODEL)[0].address == "b:1"
    # ...more than two cheap ones.
    cheap_queue = CostModel(compute_block_seconds=0.01, load_block_seconds=0.001, queue_seconds=0.01)
    assert rank(pods, blocks=100, pool_blocks=90, prefix_aware=True, model=cheap_queue)[0].address == "a:1"


def test_prefill_cost_counts_loads_and_computes() -> None:
    assert prefill_cost(blocks=10, pool_blocks=0, local_blocks=0, model=MODEL) == 10 * 0.01
    assert prefill_cost(blocks=10, pool_blocks=6, local_blocks=2, model=MODEL) == 4 * 0.01 + 4 * 0.001
    assert prefill_cost(blocks=10, pool_blocks=3, local_blocks=8, model=MODEL) == 2 * 0.01
    assert prefill_cost(blocks=10, pool_blocks=10, local_blocks=10, model=MODEL) == 0


def test_unhealthy_pods_sort_last_and_ties_follow_the_tiebreak() -> None:
    pods = [Candidate("a:1", load=0, healthy=False), Candidate("b:1", load=5), Candidate("c:1", load=5)]
    assert [c.address for c in rank(pods, tiebreak={"b:1": 1, "c:1": 0})] == ["c:1", "b:1", "a:1"]
    assert [c.address for c in rank(pods, tiebreak={"b:1": 0, "c:1": 1})] == ["b:1", "c:1", "a:1"]


def test_load_takes_the_larger_of_in_flight_and_scraped() -> None:
    assert load_of(in_flight=2, running=None, waiting=None) == 2
    assert load_of(in_flight=1, running=3, waiting=4) == 7
    assert load_of(in_flight=9, running=3, waiting=4) == 9


def test_prefill_is_skipped_only_when_the_pool_is_known_to_hold_every_full_block() -> None:
    assert pool_prefix([True, True, False, True]) == 2
    assert pool_prefix([True, True]) == 2
    assert pool_prefix([]) == 0
    assert skip_prefill(blocks=4, pool_blocks=4, pool_known=True)
    assert not skip_prefill(blocks=4, pool_blocks=3, pool_known=True)
    assert not skip_prefill(blocks=4, pool_blocks=0, pool_known=False)
    assert skip_prefill(blocks=0, pool_blocks=0, pool_known=True)  # nothing to write: decode computes the tail


def test_usage_cached_tokens_count_what_neither_step_computed() -> None:
    prefill = {"prompt_tokens": 100, "completion_tokens": 1,
               "daybreak": {"computed_tokens": 40, "pool_hit_tokens": 48, "bytes_written": 4096, "bytes_read": 10}}
    decode = {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 96},
              "daybreak": {"computed_tokens": 4, "pool_hit_tokens": 96, "bytes_read": 8192}}
    usage = combine_usage(prefill, decode)
    assert usage is not None
    assert usage["completion_tokens"] == 7
    # Prefill computed positions 60-99, decode 96-99 (the partial tail block the pool cannot hold):
    # 40 computed in all, 60 cached (not 100 - 44: the tail is not computed twice over).
    assert usage["prompt_tokens_details"]["cached_tokens"] == 60
    assert usage["daybreak"]["computed_tokens"] == 44  # the work both steps did
    assert usage["daybreak"]["bytes_read"] == 8202 and usage["daybreak"]["bytes_written"] == 4096
    assert usage["daybreak"]["pool_hit_tokens"] == 144
    # Prefill skipped: decode's own count stands.
    alone = combine_usage(None, decode)
    assert alone is not None and alone["prompt_tokens_details"]["cached_tokens"] == 96
    # An engine without the extension (vLLM) keeps its own cached_tokens.
    vllm = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    assert combine_usage({"prompt_tokens": 10}, vllm) == vllm


def test_load_is_read_from_prometheus_text_with_labels_and_timestamps() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests running",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m a",engine="0"} 3.0',
        'vllm:num_requests_running{model_name="m",engine="1"} 2 1700000000000',
        "vllm:num_requests_waiting 4",
        "vllm:num_requests_waiting_total 99",
        'vllm:num_requests_running_by_lora{x="y"} 50',
    ])
    assert parse_load(text) == (5.0, 4.0)
    assert parse_load("") == (None, None)
    assert parse_load("vllm:num_requests_running nan-ish\n") == (None, None)


def test_only_ready_endpoints_of_the_named_port_are_listed() -> None:
    body = {"items": [
        {"ports": [{"name": "http", "port": 8000}], "endpoints": [
            {"addresses": ["127.1.0.5"], "conditions": {"ready": True}},
            {"addresses": ["127.1.0.6"], "conditions": {"ready": False}},
            {"addresses": ["127.1.0.7"], "conditions": {}},  # unknown counts as ready
        ]},
        {"ports": [{"name": "metrics", "port": 9000}], "endpoints": [{"addresses": ["127.1.0.8"]}]},
        {"ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["fd00::1"]}]},
    ]}
    assert endpoints_from_slices(body) == ["127.1.0.5:8000", "127.1.0.7:8000", "[fd00::1]:8000"]
    assert endpoints_from_slices({}) == []


def test_ready_pods_stand_in_for_slices_with_their_named_port() -> None:
    service = {"spec": {"ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}}

    def pod(ip: str, port: int, *, ready: str = "True", deleting: bool = False) -> dict[str, object]:
        meta: dict[str, object] = {"name": ip}
        if deleting:
            meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        return {"metadata": meta, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}}

    pods = {"items": [pod("127.1.0.1", 8000), pod("127.1.0.2", 8001), pod("127.1.0.3", 8000, ready="False"),
                      pod("127.1.0.4", 8000, deleting=True), {"metadata": {}, "status": {}}]}
    assert endpoints_from_pods(service, pods) == ["127.1.0.1:8000", "127.1.0.2:8001"]
    numeric = {"spec": {"ports": [{"name": "http", "port": 80, "targetPort": 9000}]}}
    assert endpoints_from_pods(numeric, pods) == ["127.1.0.1:9000", "127.1.0.2:9000"]
    assert endpoints_from_pods({"spec": {"ports": [{"name": "grpc", "port": 1}]}}, pods) == []


def test_pool_status_endpoints_are_objects_with_address_and_port() -> None:
    pool = {"status": {"endpoints": [{"node": "n1", "address": "127.0.1.1", "port": 7480, "transports": ["tcp"]},
                                     {"node": "n2", "address": "127.0.1.2", "port": 0}, "127.0.0.1:1", None]}}
    assert endpoints_from_pool(pool) == ["127.0.1.1:7480"]
    assert endpoints_from_pool({}) == []


def test_the_request_namespace_is_the_best_decode_pods_among_those_prefill_also_serves() -> None:
    old = Candidate("10.0.0.1:8000", load=0, kv_namespace="ns-old")
    new = Candidate("10.0.0.2:8000", load=3, kv_namespace="ns-new")
    assert request_namespace([old, new]) == "ns-old"  # colocated: the least-loaded pod's
    # Mid-upgrade prefill already rolled: only the new namespace can pair, though its decode pod is busier.
    assert request_namespace([old, new], prefill=[Candidate("10.0.1.1:8000", kv_namespace="ns-new")]) == "ns-new"
    # A prefill namespace no decode pod serves changes nothing (decode computes what the pool lacks).
    assert request_namespace([old, new], prefill=[Candidate("10.0.1.1:8000", kv_namespace="ns-x")]) == "ns-old"
    # An unhealthy prefill pod does not pull requests into its namespace.
    sick = Candidate("10.0.1.1:8000", kv_namespace="ns-new", healthy=False)
    assert request_namespace([old, new], prefill=[sick]) == "ns-old"
    # Static endpoints carry no label: the router's --kv-namespace.
    assert request_namespace([Candidate("127.0.0.1:1")], default="sim") == "sim"
    assert request_namespace([], default=None) is None


def test_only_pods_of_the_request_namespace_or_unlabelled_ones_are_candidates() -> None:
    pods = [Candidate("a:1", kv_namespace="n1"), Candidate("b:1", kv_namespace="n2"), Candidate("c:1")]
    assert [c.address for c in in_namespace(pods, "n1")] == ["a:1", "c:1"]
    assert [c.address for c in in_namespace(pods, None)] == ["a:1", "b:1", "c:1"]


def _pod(ip: str, label: str | None, port: int = 8000) -> dict[str, object]:
    labels = {"daybreak.dev/kv-namespace": label} if label else {}
    return {"metadata": {"labels": labels}, "status": {"podIP": ip},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]}}


def test_endpoints_take_the_kv_namespace_of_their_pod() -> None:
    index = pod_namespace_index({"items": [_pod("10.0.0.1", "n1"), _pod("fd00::2", "n2"), _pod("10.0.0.5", None),
                                           # the local cluster: two pods on one loopback IP, told apart by port
                                           _pod("127.0.0.1", "old", 9001), _pod("127.0.0.1", "new", 9002)]})
    assert namespaces_of(["10.0.0.1:8000", "[fd00::2]:8000", "10.0.0.9:8000", "10.0.0.5:8000",
                          "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"], index) == {
        "10.0.0.1:8000": "n1", "[fd00::2]:8000": "n2", "10.0.0.9:8000": None, "10.0.0.5:8000": None,
        "127.0.0.1:9001": "old", "127.0.0.1:9002": "new", "127.0.0.1:9003": None}
    # Slices may name a port the pod spec does not list: the IP alone answers when unambiguous.
    assert namespaces_of(["10.0.0.1:1234"], index) == {"10.0.0.1:1234": "n1"}


def test_the_router_pairs_prefill_and_decode_pods_of_one_kv_namespace() -> None:
    """Mid-upgrade both namespaces are live in both roles: every request's two pods share one."""
    prefill = RolePods("prefill", static=["10.0.1.1:8000", "10.0.1.2:8000"])
    decode = RolePods("decode", static=["10.0.2.1:8000", "10.0.2.2:8000"])
    namespace_of = {"10.0.1.1:8000": "ns-old", "10.0.2.1:8000": "ns-old",
                    "10.0.1.2:8000": "ns-new", "10.0.2.2:8000": "ns-new"}
    for pods in (prefill, decode):
        for pod in pods.pods():
            pod.kv_namespace = namespace_of[pod.address]
    router = Router(config=RouterConfig(), prefill=prefill, decode=decode)

    async def one_request() -> tuple[str | None, str | None, str | None]:
        ns = router._request_namespace()
        pair = []
        for pods in (prefill, decode):
            pair.append(await router._choose(pods, set(), started=time.monotonic(), keys=[], pool_blocks=0,
                                             prefix_aware=False, kv_namespace=ns))
        return ns, pair[0], pair[1]

    seen = set()
    for _ in range(40):
        ns, p, d = asyncio.run(one_request())
        assert p is not None and d is not None
        assert namespace_of[p] == namespace_of[d] == ns, (ns, p, d)
        seen.add(ns)
    assert seen == {"ns-old", "ns-new"}  # equal pods share the load across namespaces too


def test_decode_falls_back_to_another_namespace_once_its_own_pods_are_tried_and_prefill_does_not() -> None:
    prefill = RolePods("prefill", static=["10.0.1.1:8000"])
    decode = RolePods("decode", static=["10.0.2.1:8000", "10.0.2.2:8000"])
    for pod, ns in zip([*prefill.pods(), *decode.pods()], ["ns-old", "ns-old", "ns-new"], strict=True):
        pod.kv_namespace = ns
    router = Router(config=RouterConfig(deadline_seconds=0.3), prefill=prefill, decode=decode)

    async def choose(pods: RolePods, tried: set[str], *, widen: bool) -> str | None:
        return await router._choose(pods, tried, started=time.monotonic(), keys=[], pool_blocks=0,
                                    prefix_aware=False, kv_namespace="ns-old", widen=widen)

    assert asyncio.run(choose(decode, set(), widen=True)) == "10.0.2.1:8000"  # its own namespace first
    # The old pod answered 503 (draining): the retry goes to the new namespace rather than failing.
    assert asyncio.run(choose(decode, {"10.0.2.1:8000"}, widen=True)) == "10.0.2.2:8000"
    # Prefill never leaves the namespace: a prefill elsewhere writes blocks this request cannot use.
    assert asyncio.run(choose(prefill, set(), widen=False)) == "10.0.1.1:8000"
    prefill.pods()[0].kv_namespace = "ns-new"
    assert asyncio.run(choose(prefill, set(), widen=False)) is None


def test_the_role_list_is_polled_until_its_watch_delivers_and_again_once_the_watch_fails() -> None:
    """The watch only decides how often the list is read: every refresh period without it, at its events
    (and the long resync) with it."""
    reads: list[float] = []

    async def lister() -> dict[str, str | None]:
        reads.append(asyncio.get_running_loop().time())
        return {"10.0.0.1:8000": None}

    async def count_reads(watch: Any, seconds: float) -> int:
        pods = RolePods("decode", lister=lister, watch=watch, refresh_seconds=0.05, resync_seconds=60.0,
                        scrape_seconds=60.0)
        reads.clear()
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(pods.run(session))
            await asyncio.sleep(seconds)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return len(reads)

    events = asyncio.Event()

    async def healthy(on_event: Any) -> None:
        on_event()  # the slices that exist
        await events.wait()  # then quiet

    async def broken(on_event: Any) -> None:
        raise OSError("connection refused")

    async def scenario() -> tuple[int, int, int]:
        return (await count_reads(None, 0.5), await count_reads(healthy, 0.5), await count_reads(broken, 0.5))

    polled, watched, failed = asyncio.run(scenario())
    assert polled >= 5  # every 0.05 s
    assert watched <= 3  # the first read, and the one the watch's first event asks for
    assert failed >= 5  # a watch that fails leaves the polling on
