"""Agents defined outside skyrl, referenced as 'tests.train.generator.user_agents:name'. They talk plain
HTTP (httpx) to the run's endpoint, as any harness would."""

import asyncio
import threading

import httpx

from skyrl.train.generator.agent import AgentResult, ClientInfo


def _body(info: ClientInfo, messages: list[dict], **extra) -> dict:
    return {"model": info.model, "messages": messages, **extra}


def _headers(info: ClientInfo) -> dict[str, str]:
    return {**info.headers, "Authorization": f"Bearer {info.api_key}"}


async def chat(info: ClientInfo, messages: list[dict], **extra) -> httpx.Response:
    async with httpx.AsyncClient(base_url=info.base_url, timeout=60) as http:
        return await http.post(
            "/chat/completions", json=_body(info, messages, **extra), headers=_headers(info)
        )


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def chatty(row, info: ClientInfo) -> AgentResult:
    """The agent twin of tests.envs.user_envs:ChattyEnv: answers "Again." twice, reward 1 after the third turn."""
    messages = list(row.prompt)
    for _ in range(2):
        messages += [{"role": "assistant", "content": content(await chat(info, messages))}]
        messages += [{"role": "user", "content": "Again."}]
    await chat(info, messages)
    return AgentResult(reward=1.0)


def rewriting(row, info: ClientInfo) -> AgentResult:
    """A sync harness that rewrites its history: every request is the system prompt and one summary of
    the guesses so far. One reward per request."""
    tried: list[str] = []
    with httpx.Client(base_url=info.base_url, timeout=60) as http:
        for _ in range(3):
            messages = [row.prompt[0], {"role": "user", "content": f"Guess. Tried: {' '.join(tried)}"}]
            response = http.post("/chat/completions", json=_body(info, messages), headers=_headers(info))
            tried.append(content(response))
    return AgentResult(reward=[0.0, 0.5, 1.0], metrics={"tried": float(len(tried))})


def stuck(row, info: ClientInfo) -> AgentResult:
    """A sync harness that never returns when the row's `stuck` column is true, else `rewriting`."""
    if row.extras.get("stuck"):
        threading.Event().wait()
    return rewriting(row, info)


async def token_level(row, info: ClientInfo) -> AgentResult:
    """A harness that builds its prompts from token ids (`/v1/completions`, no logprobs asked): the second
    prompt is the first prompt, its answer and two more tokens."""
    async with httpx.AsyncClient(base_url=info.base_url, timeout=60) as http:
        body = {"model": info.model, "prompt": "Guess the number.", "max_tokens": 3}
        first = (await http.post("/completions", json=body, headers=_headers(info))).json()
        prompt = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + first["prompt_token_ids"][:2]
        second = await http.post("/completions", json={**body, "prompt": prompt}, headers=_headers(info))
    assert second.status_code == 200, second.text
    return AgentResult(reward=1.0)


async def flaky(row, info: ClientInfo) -> AgentResult:
    """One request, then raises when the row's `fail` column is true."""
    content(await chat(info, list(row.prompt)))
    if row.extras.get("fail"):
        raise RuntimeError("simulated agent crash")
    return AgentResult(reward=1.0)


async def slow(row, info: ClientInfo) -> AgentResult:
    """One request, then hangs: leaves its session id behind for a late request."""
    content(await chat(info, list(row.prompt)))
    LATE.append(info)
    await asyncio.sleep(60)
    return AgentResult(reward=1.0)


LATE: list[ClientInfo] = []


async def silent(row, info: ClientInfo) -> float:
    """Returns a bare reward without asking the model anything."""
    return 0.5


async def miscounted(row, info: ClientInfo) -> AgentResult:
    content(await chat(info, list(row.prompt)))
    return AgentResult(reward=[1.0, 1.0])


async def blocking(row, info: ClientInfo) -> AgentResult:
    """An async agent that blocks its event loop with a sync HTTP call (a common mistake)."""
    with httpx.Client(base_url=info.base_url, timeout=60) as http:
        response = http.post("/chat/completions", json=_body(info, list(row.prompt)), headers=_headers(info))
    content(response)
    return AgentResult(reward=1.0)


async def best_of_two(row, info: ClientInfo) -> AgentResult:
    """Asks for n=2 in a training session: refused."""
    response = await chat(info, list(row.prompt), n=2)
    assert response.status_code == 400 and "n=2" in response.json()["error"]["message"], response.text
    return AgentResult(reward=1.0)


not_a_function = 3
