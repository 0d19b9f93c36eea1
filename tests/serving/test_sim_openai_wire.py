"""The OpenAI wire helpers the sim engine and the router share: SSE framing, usage, request fields."""

from __future__ import annotations

import pytest

from daybreak.serving import openai


def test_sse_events_round_trip_and_stop_at_done() -> None:
    stream = openai.sse({"a": 1}) + b": comment\n\n" + openai.sse({"b": [2]}) + openai.DONE + openai.sse({"c": 3})
    assert stream.startswith(b"data: {") and openai.DONE == b"data: [DONE]\n\n"
    assert list(openai.parse_sse(stream)) == [{"a": 1}, {"b": [2]}]


def test_usage_carries_cached_tokens_and_every_daybreak_field() -> None:
    usage = openai.usage_dict(prompt_tokens=100, completion_tokens=5, cached_tokens=64,
                              daybreak={"pool_hit_tokens": 48, "local_hit_tokens": 16, "computed_tokens": 36})
    assert usage["total_tokens"] == 105 and usage["prompt_tokens_details"] == {"cached_tokens": 64}
    assert set(usage["daybreak"]) == set(openai.DAYBREAK_USAGE_FIELDS)
    assert usage["daybreak"]["bytes_read"] == 0 and usage["daybreak"]["pool_hit_tokens"] == 48
    assert "daybreak" not in openai.usage_dict(prompt_tokens=1, completion_tokens=1, cached_tokens=0)


def test_bodies_have_openais_shapes() -> None:
    usage = openai.usage_dict(prompt_tokens=1, completion_tokens=2, cached_tokens=0)
    text = openai.response_body(kind="completion", rid="cmpl-1", model="m", text="hi", finish_reason="length",
                                usage=usage)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hi"
    chat = openai.response_body(kind="chat", rid="c", model="m", text="hi", finish_reason="length", usage=usage)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "hi"
    first = openai.chunk_body(kind="chat", rid="c", model="m", text="h", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "h"}
    last = openai.chunk_body(kind="chat", rid="c", model="m", text=None, finish_reason="length")
    assert last["choices"][0]["delta"] == {} and last["object"] == "chat.completion.chunk"
    tail = openai.usage_chunk(kind="completion", rid="x", model="m", usage=usage)
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 2
    assert openai.request_id("chat").startswith("chatcmpl-") and openai.request_id("completion").startswith("cmpl-")


def test_request_fields_are_checked_and_named() -> None:
    assert openai.stream_settings({}) == (False, False)
    assert openai.stream_settings({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    for body, field in [({"stream": 1}, "stream"), ({"stream_options": []}, "stream_options"),
                        ({"stream_options": {"include_usage": "y"}}, "include_usage")]:
        with pytest.raises(openai.RequestError, match=field):
            openai.stream_settings(body)
    assert openai.max_tokens({}) == 16 and openai.max_tokens({"max_completion_tokens": 3}) == 3
    assert openai.max_tokens({"max_tokens": None, "max_completion_tokens": 4}) == 4
    for bad in (0, -1, True, 1.5, "2", 1 << 21):
        with pytest.raises(openai.RequestError, match="max_tokens"):
            openai.max_tokens({"max_tokens": bad})
