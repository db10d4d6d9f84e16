"""The OpenAI-compatible endpoint with a real HTTP client on 127.0.0.1 and a real engine behind it."""

import asyncio
import threading
import time
from http.client import HTTPConnection

import httpx
import pytest

from skyrl.train.schema import OpenAIServerConfig

from .conftest import serving

API_KEY = "test-key"
MODEL = "tiny"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_path):
    with serving(tiny_model_path, OpenAIServerConfig(port=0, api_key=API_KEY, served_model_name=MODEL)) as (
        _,
        server,
    ):
        yield server


@pytest.fixture
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as http:
        yield http


def assert_error(response, status, text):
    assert response.status_code == status, response.text
    assert text in response.json()["error"]["message"]


def test_server_binds_localhost_on_a_free_port(server):
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0


def test_models_lists_the_served_model(http):
    response = http.get("/v1/models")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [MODEL]


def test_completion_returns_text_token_ids_and_logprobs(http, tokenizer):
    body = {"model": MODEL, "prompt": "Guess the hidden number", "max_tokens": 6, "seed": 1, "logprobs": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert data["prompt_token_ids"] == tokenizer.encode("Guess the hidden number")
    assert 1 <= len(choice["token_ids"]) <= 6 and choice["finish_reason"] in ("stop", "length")
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert data["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_completion_accepts_token_ids_and_n(http):
    body = {"model": MODEL, "prompt": [1, 20, 21], "max_tokens": 3, "temperature": 0, "n": 2}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["token_ids"] for c in response.json()["choices"]] == [[21, 21, 21]] * 2


def test_completion_cuts_the_stop_string_from_the_text(http, tokenizer):
    body = {"model": MODEL, "prompt": [1, 10, 11], "max_tokens": 12, "seed": 4}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next(full[i : i + 2] for i in range(2, len(full) - 1) if full[i : i + 2].strip().isalnum())
    choice = http.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.index(stop)]


def test_chat_completion_uses_the_chat_template(http, tokenizer):
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Guess"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "seed": 2, "logprobs": True}
    response = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "episode-1"})
    assert response.status_code == 200, response.text
    data = response.json()
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert data["prompt_token_ids"] == expected
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_bad_json_is_a_400(http):
    response = http.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert_error(response, 400, "malformed request")


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, "outside the vocabulary"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "content"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL]},
            "generator.http_endpoint.tool_parser",
        ),
    ],
    ids=[
        "no-prompt",
        "negative-temperature",
        "out-of-vocab",
        "no-messages",
        "message-without-content",
        "tools-without-a-parser",
    ],
)
def test_malformed_request_is_a_400(http, path, body, text):
    assert_error(http.post(path, json=body), 400, text)


def test_unknown_model_is_a_404(http):
    response = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert_error(response, 404, "'gpt-9' does not exist")
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
def test_bad_or_missing_api_key_is_a_401(server, headers):
    response = httpx.get(f"{server.url}/v1/models", headers=headers)
    assert_error(response, 401, "API key")


def test_server_keeps_serving_after_errors(http):
    http.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [1, 20, 21], "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == [21, 21]


def test_a_paused_server_holds_new_requests_and_serves_them_after(server, http):
    """As during a weight sync: a request that arrives while paused waits, and is answered after."""
    loop = server._task.get_loop()
    asyncio.run_coroutine_threadsafe(server.pause(), loop).result(timeout=10)
    body = {"model": MODEL, "prompt": [1, 20, 21], "max_tokens": 2, "temperature": 0}
    answers = []
    request = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
    request.start()
    request.join(timeout=1.0)
    assert request.is_alive() and not answers  # held, not refused
    asyncio.run_coroutine_threadsafe(server.resume(), loop).result(timeout=10)
    request.join(timeout=60)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["choices"][0]["token_ids"] == [21, 21]


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"prompt": [1, 20], "max_tokens": -1}, "max_tokens"),
        ({"prompt": [1, 20], "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [1, 20], "temperature": "hot"}, "temperature"),
        ({"prompt": [1] * 2048, "max_tokens": 2}, "not fewer than the maximum model length 2048"),
    ],
    ids=["negative-max-tokens", "max-tokens-not-a-number", "temperature-not-a-number", "prompt-over-context"],
)
def test_out_of_range_requests_are_a_400(http, body, text):
    assert_error(http.post("/v1/completions", json={"model": MODEL, **body}), 400, text)


def test_a_huge_max_tokens_stops_at_the_context(http):
    body = {"model": MODEL, "prompt": [1] * 2044, "max_tokens": 10**9, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 2048 - 2044


def test_64_concurrent_openai_clients_are_served_and_a_wrong_key_is_refused(server):
    """The official client, as agents use it: every concurrent request answered, a bad key a 401."""
    import openai

    async def clients():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "Guess."}]
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=i)
                for i in range(64)
            )
        )
        wrong = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            await wrong.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=0)
        return replies

    replies = asyncio.run(clients())
    assert len(replies) == 64 and all(1 <= r.usage.completion_tokens <= 3 for r in replies)
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)


def test_an_idle_connection_stays_open_while_the_run_trains(server):
    """Agents' pooled connections idle through a training step; the server must not close them under
    the clients (uvicorn's default closes them after 5 s, racing the clients' next request)."""
    conn = HTTPConnection(server.cfg.host, server.port, timeout=30)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        for attempt in range(2):  # the same connection (http.client does not reconnect), the second time idle
            if attempt:
                time.sleep(6)  # idle past uvicorn's default keep-alive (5 s)
            conn.request("GET", "/v1/models", headers=headers)
            response = conn.getresponse()
            assert response.status == 200 and b"tiny" in response.read()
    finally:
        conn.close()
