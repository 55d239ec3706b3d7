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


def test_an_explicit_null_is_the_fields_default_and_a_wrong_value_still_names_it():
    request = decode_request(
        b'{"prompt": "x", "max_tokens": null, "temperature": null, "top_p": null,'
        b' "top_k": null, "seed": null, "stop": null, "stream": null, "n": null, "echo": null}'
    )
    assert request.stream is False and request.n == 1 and request.echo is False
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k) == (
        16,
        1.0,
        1.0,
        0,
    )
    assert request.seed is None and request.stops == []
    with pytest.raises(CompletionError) as raised:
        decode_request(b'{"prompt": "x", "max_tokens": "many"}')
    assert raised.value.param == "max_tokens"


def test_a_bpe_stream_gives_whole_characters_and_finds_stops_across_tokens():
    from silentswarm.agent.runtime.tokenizer import train_bpe

    tokenizer = train_bpe([("hello world héllo 世界 é " * 50).encode()], 300)
    text = "héllo 世界 é <|endoftext|> x"
    ids = [int(i) for i in tokenizer.encode(text.encode())]
    assembler = TextAssembler(tokenizer, [])
    assert "".join(assembler.add(i) for i in ids) + assembler.finish() == text
    stopping = TextAssembler(tokenizer, ["界"])
    assert "".join(stopping.add(i) for i in ids) == "héllo 世" and stopping.stopped
    assert tokenizer.max_token_bytes >= max(len(tokenizer.token_bytes(i)) for i in ids)


def test_a_tiny_temperature_is_greedy_not_a_nan():
    logits = np.array([0.0, 3.0, 1.0])
    assert sample(logits, Sampling(temperature=1e-310), np.random.default_rng(0)) == 1
    assert sample(logits, Sampling(temperature=1e-310, top_p=0.5), np.random.default_rng(0)) == 1


class SlowStepper:
    """A stand-in model: ``slots`` slots, uniform logits over ``vocab``; each step takes a
    millisecond (a model's time)."""

    def __init__(self, slots: int = 1, vocab: int = 4, seq_len: int = 10_000) -> None:
        self.slots, self.vocab, self.seq_len = slots, vocab, seq_len

    def start(self, slot, ids):
        return np.zeros(self.vocab)

    def step(self, slots, tokens, positions):
        import time

        time.sleep(0.001)
        return np.zeros((len(slots), self.vocab))


def test_a_waiting_request_that_is_cancelled_leaves_the_queue_at_once():
    import threading

    from silentswarm.agent.serve.engine import Engine, Finished, Job

    events: dict[str, list] = {"a": [], "b": []}
    ended, started = threading.Event(), threading.Event()

    def emit(name):
        def put(event):
            events[name].append(event)
            if name == "b" and isinstance(event, Finished):
                ended.set()
            started.set()

        return put

    engine = Engine(SlowStepper(), max_waiting=1)
    engine.start()
    try:
        running = Job(ids=[1], max_tokens=100_000, sampling=Sampling(), emit=emit("a"))
        waiting = Job(ids=[1], max_tokens=5, sampling=Sampling(), emit=emit("b"))
        engine.submit(running)
        assert started.wait(5)  # it holds the one slot
        engine.submit(waiting)
        assert engine.counts[1] == 1
        engine.cancel(waiting)
        assert ended.wait(5) and events["b"] == [Finished("cancelled")]
        assert engine.counts == (1, 0)  # its place is free: another may queue
        engine.submit(Job(ids=[1], max_tokens=1, sampling=Sampling(), emit=emit("a")))
    finally:
        engine.cancel(running)
        engine.stop()
