"""`echo` and `logprobs` as lm-eval-harness and OpenAI clients read them, on a server in this
process over the real default model (float weights, so the server computes what the tests
compute): the echoed prompt's log-probabilities are its teacher-forced loss, generated tokens'
are the raw next-token distribution (before temperature), greedy tokens top their lists, the
stream carries what the whole response does, and bad values are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from larql.inference.ffn import DenseFfn
from larql.inference.generation import teacher_forced_logits
from larql.kv import parse_engine
from larql.models import Model
from larql.server.app import create_app
from larql.server.runner import serve_in_thread
from larql.server.settings import ServerSettings

TEXT = (
    "The capital of France is Paris. It is known for the Eiffel Tower, which was built in "
    "1889 for the World's Fair, and for the Louvre museum."
)
BOUND_S = 120  # bounds on waiting, never asserted as timings
EXACT = 1e-5  # the same computation on both sides: float64 rounding of float32 logits


@pytest.fixture(scope="module")
def url(smollm2: Model) -> Iterator[str]:
    with serve_in_thread(create_app(smollm2, ServerSettings(max_new_tokens=64))) as running:
        running.wait_started(BOUND_S)
        yield running.url


def post(url: str, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=BOUND_S)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def reference(model: Model, ids: list[int], prompt_len: int, spec: str = "standard") -> list[float]:
    """ln P(ids[i] | ids[:i]) for i ≥ 1 by the project's teacher forcing: `ids[:prompt_len]`
    prefilled (every row kept), each later id fed as a decode step."""
    engine = parse_engine(spec).build(model)
    logits = teacher_forced_logits(
        engine, model, DenseFfn(model), ids, prompt_len, prompt_rows=True
    )  # [len(ids), V]: row i predicts ids[i + 1], the last predicts past the end
    assert logits.shape[0] == len(ids)
    log_p = torch.log_softmax(logits[:-1].double(), dim=-1)  # [len(ids) − 1, V]
    return log_p.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def check_top(logprobs: dict[str, Any], n: int) -> None:
    """Every scored token: logprob ≤ 0, `n` alternatives best first, none better than the best."""
    for lp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        if lp is None:
            assert top is None
            continue
        values = list(top.values())
        assert len(values) == n and lp <= 0
        assert values == sorted(values, reverse=True)
        if n:
            assert lp <= values[0] + 1e-12


def check_offsets(text: str, logprobs: dict[str, Any]) -> None:
    """ASCII text: every token's string sits at its offset, and the strings tile the text."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets, strict=True):
        assert text[offset : offset + len(token)] == token
    assert "".join(tokens) == text


# ---------------------------------------------------------------------------- the prompt


def test_echoed_prompt_sums_to_the_teacher_forced_loss(url: str, smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    out = ok(post(url, prompt=TEXT, echo=True, max_tokens=0, logprobs=5))
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == TEXT and out["larql"]["token_ids"] == []
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    assert logprobs["tokens"] == [smollm2.tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids)
    served = logprobs["token_logprobs"][1:]
    expected = reference(smollm2, ids, len(ids))
    assert abs(sum(served) - sum(expected)) <= EXACT  # minus the teacher-forced loss
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= EXACT
    # and the same loss within float32 noise when the prompt is fed one token at a time
    assert abs(sum(served) - sum(reference(smollm2, ids, 1))) <= 1e-3
    check_top(logprobs, 5)
    check_offsets(TEXT, logprobs)


def test_no_cache_scores_a_prompt_from_its_own_pass(url: str, smollm2: Model) -> None:
    """no-cache's prefill returns every prompt row: its prompt is scored from that one pass
    (no token-by-token re-run), the numbers of the prompt fed token by token within float32
    noise."""
    prompt = "The capital of France is Paris."
    ids = smollm2.tokenizer.encode(prompt)
    out = ok(post(url, prompt=prompt, echo=True, max_tokens=0, logprobs=0, engine="no-cache"))
    served = out["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert out["larql"]["engine"] == "no-cache"
    assert abs(sum(served) - sum(reference(smollm2, ids, len(ids), "no-cache"))) <= EXACT
    assert abs(sum(served) - sum(reference(smollm2, ids, 1, "no-cache"))) <= 1e-3
    assert abs(sum(served) - sum(reference(smollm2, ids, len(ids)))) <= 1e-3
    assert out["choices"][0]["logprobs"]["top_logprobs"][1:] == [{}] * (len(ids) - 1)


# ---------------------------------------------------------------------------- generated tokens


def test_greedy_tokens_top_their_lists_and_echo_comes_first(url: str, smollm2: Model) -> None:
    prompt = "The capital of France is"
    ids = smollm2.tokenizer.encode(prompt)
    plain = ok(post(url, prompt=prompt, max_tokens=6, temperature=0, logprobs=3))
    echoed = ok(post(url, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True))
    generated = plain["larql"]["token_ids"]
    assert echoed["larql"]["token_ids"] == generated and len(generated) == 6
    text = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == prompt + text
    lp = plain["choices"][0]["logprobs"]
    assert lp["tokens"] == [smollm2.tokenizer.decode([t]) for t in generated]
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert next(iter(top)) == token and logprob == max(top.values())
    check_top(lp, 3)
    check_offsets(text, lp)
    both = echoed["choices"][0]["logprobs"]
    check_offsets(prompt + text, both)
    assert both["token_logprobs"][len(ids) :] == lp["token_logprobs"]
    assert both["text_offset"][len(ids) :] == [len(prompt) + o for o in lp["text_offset"]]
    expected = reference(smollm2, ids + generated, len(ids))
    assert max(abs(a - b) for a, b in zip(both["token_logprobs"][1:], expected, strict=True)) <= (
        EXACT
    )


def test_sampled_tokens_are_scored_before_temperature(url: str, smollm2: Model) -> None:
    prompt = "Once upon a time"
    ids = smollm2.tokenizer.encode(prompt)
    out = ok(post(url, prompt=prompt, max_tokens=8, temperature=1.7, seed=5, logprobs=1))
    generated = out["larql"]["token_ids"]
    served = out["choices"][0]["logprobs"]["token_logprobs"]
    expected = reference(smollm2, ids + generated, len(ids))[len(ids) - 1 :]
    # at temperature 1.7 a token can be improbable (ln p ≈ −17 here): the float32 rounding of
    # logits that far down is relative to their size; scores after temperature would be off by
    # whole nats
    for a, b in zip(served, expected, strict=True):
        assert abs(a - b) <= EXACT * max(1.0, abs(b)), (a, b)


def test_a_stop_token_is_scored_at_the_end_of_the_text(url: str, smollm2: Model) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    ids = smollm2.tokenizer.encode_chat(messages)
    out = ok(post(url, prompt=ids, max_tokens=64, temperature=0, logprobs=1))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"  # the model ends its turn with a stop token
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(out["larql"]["token_ids"])
    assert lp["tokens"][-1] == smollm2.tokenizer.decode([out["larql"]["token_ids"][-1]])
    assert lp["text_offset"][-1] == len(choice["text"])


def test_stream_carries_what_the_whole_response_does(url: str) -> None:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
    }
    whole = ok(post(url, **body))["choices"][0]
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in stream(url, "/v1/completions", body):
        choice = chunk["choices"][0]
        text += choice["text"]
        for key, values in (choice["logprobs"] or {}).items():
            merged[key] += values
    assert text == whole["text"] and merged == whole["logprobs"]


def stream(url: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=BOUND_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    yield chunk


# ---------------------------------------------------------------------------- chat


def test_chat_logprobs_shape_whole_and_streamed(url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
    }
    out = ok(post(url, "/v1/chat/completions", **body))
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 5
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"}
        assert c["bytes"] == list(c["token"].encode("utf-8")) and c["logprob"] <= 0
        top = c["top_logprobs"]
        assert len(top) == 4 and [t["logprob"] for t in top] == sorted(
            (t["logprob"] for t in top), reverse=True
        )
        assert top[0]["token"] == c["token"] and top[0]["logprob"] == c["logprob"]  # greedy
    streamed = [
        item
        for chunk in stream(url, "/v1/chat/completions", body)
        for item in (chunk["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    # the same tokens; the streamed request's prompt starts from the prefix cache's copy of the
    # first one's state, so its log-probabilities may differ in the order of float sums
    assert _tokens_of(streamed) == _tokens_of(content)
    assert _logprobs_of(streamed) == pytest.approx(_logprobs_of(content), abs=1e-4)
    bare = ok(post(url, "/v1/chat/completions", **{**body, "top_logprobs": None}))
    assert all(c["top_logprobs"] == [] for c in bare["choices"][0]["logprobs"]["content"])
    off = ok(post(url, "/v1/chat/completions", **{**body, "logprobs": False, "top_logprobs": None}))
    assert off["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------------------- lm-eval-harness


def test_lm_eval_loglikelihood_request(url: str, smollm2: Model) -> None:
    """The body lm-eval's local-completions sends for loglikelihood (a batch of token-id
    prompts, echo, one generated token) and how it reads the answer: the continuation's
    logprobs are token_logprobs[ctxlen:-1], greedy when each is its list's maximum."""
    tokenizer = smollm2.tokenizer
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " Berlin"),
        ("Two plus two equals", " four"),
    ]
    batch, ctxlens = [], []
    for context, continuation in pairs:
        ctx = tokenizer.encode(context)
        batch.append(ctx + tokenizer.encode(continuation, add_special_tokens=False))
        ctxlens.append(len(ctx))
    body = {
        "model": "smollm2-135m",
        "prompt": batch,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    out = ok(post(url, **body))
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(batch)
    results = []
    for choice, ids, ctxlen in zip(choices, batch, ctxlens, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(ids) + 1
        continuation = token_logprobs[ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(continuation, tops, strict=True))
        expected = reference(smollm2, ids, len(ids))[ctxlen - 1 :]
        assert abs(sum(continuation) - sum(expected)) <= EXACT
        results.append((sum(continuation), greedy))
    assert results[0][0] > results[1][0]  # Paris over Berlin
    assert results[0][1] and not results[1][1]
    # scoring only (max_tokens=0) gives the same numbers without the generated token
    scored = ok(post(url, **{**body, "max_tokens": 0}))["choices"]
    for a, b in zip(scored, choices, strict=True):
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"][:-1]
    # and prompts as strings give one choice each, in order
    texts = [c + x for c, x in pairs]
    strings = ok(post(url, **{**body, "prompt": texts, "max_tokens": 0}))["choices"]
    assert [c["text"] for c in strings] == texts


# ---------------------------------------------------------------------------- bad values


BAD: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("logprobs negative", "/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs", "0..20"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs", "0..20"),
    ("logprobs mistyped", "/v1/completions", {"prompt": "hi", "logprobs": "1"}, "logprobs", "int"),
    ("echo mistyped", "/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo", "boolean"),
    (
        "max_tokens 0 alone",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        "max_tokens",
        "echo=true",
    ),
    (
        "max_tokens < 0 echo",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -1, "echo": True},
        "max_tokens",
        "≥ 0",
    ),
    ("mixed prompts", "/v1/completions", {"prompt": ["a", [1]]}, "prompt", "list of strings"),
    ("too many prompts", "/v1/completions", {"prompt": ["a"] * 100}, "prompt", "at most"),
    ("one bad prompt", "/v1/completions", {"prompt": [[1], [10**7]]}, "prompt", "token ids"),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "0..20",
    ),
    (
        "top_logprobs alone",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
        "logprobs=true",
    ),
    (
        "chat logprobs mistyped",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
        "logprobs",
        "boolean",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_bad_values_are_400s_naming_the_field(
    url: str, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    response = post(url, path, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert param in error["message"]


def test_a_bad_request_does_not_disturb_another(url: str) -> None:
    body = {"prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 1}
    alone = ok(post(url, **body))["choices"][0]["logprobs"]
    with httpx.Client(timeout=BOUND_S) as client:
        good = client.build_request("POST", f"{url}/v1/completions", json=body)
        bad = client.build_request("POST", f"{url}/v1/completions", json={**body, "logprobs": 50})
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first, second = pool.map(client.send, [good, bad])
    assert second.status_code == 400
    assert ok(first)["choices"][0]["logprobs"] == alone
    assert not math.isnan(sum(alone["token_logprobs"][1:]))


def _tokens_of(entries: list[dict]) -> list[tuple]:
    return [(e["token"], tuple(t["token"] for t in e["top_logprobs"])) for e in entries]


def _logprobs_of(entries: list[dict]) -> list[float]:
    return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
