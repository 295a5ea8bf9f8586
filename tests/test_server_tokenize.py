"""`larql serve`'s tokenizer endpoints, in vLLM's shapes: `/tokenize` gives the ids the server
itself would decode from (text, or chat messages through the template), `/detokenize` the text
of ids, `/tokenizer_info` the special tokens and template — what lm-eval-harness's
`tokenizer_backend=remote` reads to score log-likelihood tasks with the served model's own
tokenizer (no Hugging Face tokenizer on the client)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from larql.models import Model
from larql.server.app import create_app
from larql.server.runner import serve_in_thread
from larql.server.settings import ServerSettings

TEXT = "The capital of France is Paris.<|im_end|>"


@pytest.fixture(scope="module")
def url(smollm2_default: Model) -> Iterator[str]:
    settings = ServerSettings(max_prompt_tokens=4)  # tokenizing is not bound by it
    with serve_in_thread(create_app(smollm2_default, settings)) as running:
        running.wait_started()
        yield running.url


def test_tokenize_gives_the_servers_own_ids(url: str, smollm2_default: Model) -> None:
    tokenizer = smollm2_default.tokenizer
    plain = httpx.post(f"{url}/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
    assert plain.status_code == 200, plain.text
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert plain.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids}
    assert ids[-1] == tokenizer.tokenizer.token_to_id("<|im_end|>")  # a special token, one id
    default = httpx.post(f"{url}/tokenize", json={"prompt": TEXT, "model": "smollm2-135m"})
    assert default.json()["tokens"] == tokenizer.encode(TEXT)  # add_special_tokens: true
    turns = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": turns})
    assert chat.json()["tokens"] == tokenizer.encode_chat(turns)


def test_detokenize_is_the_inverse(url: str, smollm2_default: Model) -> None:
    ids = httpx.post(f"{url}/tokenize", json={"prompt": TEXT}).json()["tokens"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenizer_info_names_the_special_tokens(url: str, smollm2_default: Model) -> None:
    info = httpx.get(f"{url}/tokenizer_info").json()
    tokenizer = smollm2_default.tokenizer
    assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>"
    assert info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 8192 and info["vocab_size"] == tokenizer.vocab_size


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/detokenize", {"tokens": [-1]}, 400, "token id -1 is outside the vocabulary"),
        ("/detokenize", {"tokens": [10**7]}, 400, "outside the vocabulary (0..49151)"),
        ("/detokenize", {"tokens": "1 2"}, 400, "'tokens'"),
        ("/tokenize", {}, 400, "give one of 'prompt' (text) or 'messages'"),
        ("/tokenize", {"prompt": "a", "messages": []}, 400, "give one of 'prompt'"),
        ("/tokenize", {"prompt": 5}, 400, "'prompt'"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "unknown model 'gpt-4'"),
        ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "unknown model 'gpt-4'"),
    ],
)
def test_bad_input_is_an_openai_error(
    url: str, path: str, body: dict, status: int, words: str
) -> None:
    answer = httpx.post(f"{url}{path}", json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]


def test_text_longer_than_any_context_is_refused_untokenized(url: str) -> None:
    answer = httpx.post(f"{url}/tokenize", json={"prompt": "x" * 10**6})
    assert answer.status_code == 400 and "tokenizes at most" in answer.json()["error"]["message"]
    fits = httpx.post(f"{url}/tokenize", json={"prompt": "one two three four five six"})
    assert fits.status_code == 200 and fits.json()["count"] > 4  # past --max-prompt-tokens


def test_chat_without_a_template_is_refused(smollm2_default: Model) -> None:
    templateless = dataclasses.replace(
        smollm2_default,
        tokenizer=dataclasses.replace(smollm2_default.tokenizer, chat_template=None),
    )
    with serve_in_thread(create_app(templateless, ServerSettings())) as running:
        running.wait_started()
        turns = [{"role": "user", "content": "Hi"}]
        answer = httpx.post(f"{running.url}/tokenize", json={"messages": turns})
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "chat_template_missing"
        assert httpx.get(f"{running.url}/tokenizer_info").json()["chat_template"] is None
