"""The prompt contract shared by router, sim engine and load generator."""

from __future__ import annotations

import pytest

from daybreak.serving.prompt import (
    PromptError,
    block_content,
    check_block,
    parse_prompt,
    tokens_from_hash_ids,
)


def test_text_chat_and_token_prompts_parse_to_byte_tokens() -> None:
    assert parse_prompt({"prompt": "hé"}).tokens == [104, 0xC3, 0xA9]
    assert parse_prompt({"prompt": [5, 6, 7]}).tokens == [5, 6, 7]
    chat = parse_prompt({"messages": [{"role": "user", "content": "hi"}]}).tokens
    assert bytes(chat) == b"<|user|>\nhi\n<|assistant|>\n"


def test_shared_hash_ids_give_shared_prefix_keys_and_nothing_more() -> None:
    a = parse_prompt({"hash_ids": [1, 2, 3]}).keys(512)
    b = parse_prompt({"hash_ids": [1, 2, 9]}).keys(512)
    c = parse_prompt({"hash_ids": [7, 2, 3]}).keys(512)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # same later ids after a different first block share no key
    assert len(parse_prompt({"hash_ids": [1, 2, 3], "input_length": 1100}).keys(512)) == 2


def test_trace_tokens_are_cut_to_the_input_length() -> None:
    assert len(tokens_from_hash_ids([0, 1], 700)) == 700
    with pytest.raises(PromptError, match="input_length"):
        tokens_from_hash_ids([0], 513)


@pytest.mark.parametrize("body", [{}, {"prompt": 3}, {"prompt": [-1]}, {"messages": []},
                                  {"messages": [{"role": "user"}]}, {"hash_ids": "x"}, {"hash_ids": [-2]}])
def test_malformed_prompts_are_refused_naming_the_field(body: dict[str, object]) -> None:
    with pytest.raises(PromptError):
        parse_prompt(body)


def test_block_content_is_checkable_and_bound_to_its_namespace() -> None:
    data = bytearray(block_content("ns-a", "k1", 4096 + 5))
    assert check_block("ns-a", "k1", data)
    assert not check_block("ns-b", "k1", data)
    assert not check_block("ns-a", "k2", data)
    data[4000] ^= 1
    assert not check_block("ns-a", "k1", data)
