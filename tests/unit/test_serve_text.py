"""The completion server's pure parts: text pieces with stop sequences, sampling, requests."""

from __future__ import annotations

import numpy as np
import pytest

from silentswarm.agent.errors import CompletionError
from silentswarm.agent.runtime.tokenizer import ByteTokenizer
from silentswarm.agent.serve.api import decode_request
from silentswarm.agent.serve.engine import Sampling, sample
from silentswarm.agent.serve.text import TextAssembler


def pieces(text: bytes, stop: list[str]) -> tuple[list[str], bool, str]:
    assembler = TextAssembler(ByteTokenizer(), stop)
    out = []
    for byte in text:
        out.append(assembler.add(byte))
        if assembler.stopped:
            break
    return out, assembler.stopped, assembler.finish()


def test_a_character_split_across_tokens_comes_out_whole():
    out, stopped, rest = pieces("aé€".encode(), [])
    assert out == ["a", "", "é", "", "", "€"] and not stopped and rest == ""


def test_an_invalid_byte_is_replaced_not_fatal():
    out, _, rest = pieces(b"a\xffb", [])
    assert "".join(out) + rest == "a\ufffdb"


@pytest.mark.parametrize(
    ("text", "stop", "want", "stopped"),
    [
        (b"hello world", ["wor"], "hello ", True),
        (b"hello world", ["xyz"], "hello world", False),
        (b"abcabd", ["abd"], "abc", True),  # a false start is given out once it fails
        (b"one\n\ntwo", ["\n\n", "two"], "one", True),
        (b"aaa", ["ab"], "aaa", False),  # held back, then given out at the end
    ],
)
def test_a_stop_sequence_ends_the_text_and_is_not_part_of_it(text, stop, want, stopped):
    out, was_stopped, rest = pieces(text, stop)
    assert "".join(out) + rest == want and was_stopped is stopped


def test_text_that_may_start_a_stop_sequence_is_held_back_until_it_cannot():
    out, _, _ = pieces(b"xab", ["abc"])
    assert out == ["x", "", ""]  # "a", then "ab", could still become "abc"


def test_sampling_is_greedy_at_zero_and_top_p_keeps_the_likeliest():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert sample(logits, Sampling(temperature=0), rng) == 0
    drawn = {sample(logits, Sampling(temperature=1.0, top_p=0.7), rng) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reach 0.7; the rest is cut
    drawn = {sample(logits, Sampling(temperature=1.0, top_k=1), rng) for _ in range(50)}
    assert drawn == {0}
    a = [sample(logits, Sampling(), np.random.default_rng(4)) for _ in range(5)]
    b = [sample(logits, Sampling(), np.random.default_rng(4)) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "temperature": 3}', "temperature"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "echo": true}', "echo"),
        (b'{"prompt": "x", "logprobs": 2}', "logprobs"),
        (b'{"prompt": [], "max_tokens": 1}', "prompt"),
        (b'{"prompt": "x", "stop": 5}', "stop"),
        (b"[1, 2]", None),
    ],
)
def test_a_bad_request_names_its_field(body, param):
    with pytest.raises(CompletionError) as raised:
        decode_request(body)
    assert raised.value.param == param and raised.value.http_status == 400


def test_a_request_takes_what_the_openai_clients_send():
    request = decode_request(
        b'{"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "stop": "\\n",'
        b' "stream": true, "stream_options": {"include_usage": true}, "user": "u",'
        b' "presence_penalty": 0, "frequency_penalty": 0}'
    )
    assert request.prompts == ["a", "b"] and request.stops == ["\n"] and request.include_usage
