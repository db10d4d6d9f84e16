"""OpenAI function calling on the endpoint, over a tiny model whose tokenizer carries Qwen2.5's real chat
template (its tools system section, `<tool_call>` / `<tool_response>` tags as single tokens) and vLLM's
hermes parser, with real HTTP clients (httpx, `openai`) and a real hf engine. The model has memorised a
weather conversation (greedy: a call to `get_weather`, then, given its result, an answer), so the
answers that carry calls are generated, not made up."""

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput
from skyrl.train.dataset.preprocess import Trajectory, prefix_consistent
from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.agent import AgentGenerator, AgentResult, AgentSessions, ClientInfo
from skyrl.train.generator.rollout import RolloutManager
from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.openai_format import ChatCompletionRequest, ToolDefinition
from skyrl.train.inference.tools import ToolCalls, ToolRequestError, ToolUse, template_messages
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, OpenAIServerConfig, SamplingConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.utils.tiny_tools_model import QWEN25_TEMPLATE, TOOL_TAGS

from .conftest import answered, memorise, serving

MODEL = "qwen-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASKED = {"role": "user", "content": "Weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = "It is 18C."


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = create_tiny_model(
        tmp_path_factory.mktemp("qwen-tools"),
        chat_template=QWEN25_TEMPLATE.read_text(),
        added_tokens=TOOL_TAGS,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    end = tokenizer.encode("<|im_end|>")
    memorise(
        path,
        [
            (render(tokenizer, [ASKED]), tokenizer.encode(CALL) + end),
            (render(tokenizer, [ASKED, CALLED, ANSWERED]), tokenizer.encode(REPLY) + end),
        ],
    )
    return path


def render(tokenizer, messages):
    """`messages` (OpenAI's format) with the weather tool, as the endpoint renders a request's prompt."""
    tools = [ToolDefinition.model_validate(WEATHER).model_dump(exclude_none=True)]
    return tokenizer.apply_chat_template(
        template_messages([{k: v for k, v in m.items() if v is not None} for m in messages]),
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def served(ray_cluster, model_path):
    with serving(model_path, OpenAIServerConfig(port=0, served_model_name=MODEL)) as served:
        yield served


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def chat(http, messages, **fields):
    return http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4, **fields}
    )


def test_auto_picks_hermes_for_the_qwen_template_and_none_for_a_plain_one(server, tiny_model_path):
    assert server.tool_calls.name == "hermes"
    assert ToolCalls(AutoTokenizer.from_pretrained(tiny_model_path), "auto").name is None


def test_an_unknown_parser_is_a_config_error_naming_the_key_and_the_installed_ones(tokenizer):
    with pytest.raises(ConfigError, match=r"generator.http_endpoint.tool_parser='nope' .*'hermes'"):
        ToolCalls(tokenizer, "nope")


def test_tools_calls_and_tool_results_reach_the_chat_template(http, tokenizer):
    """The prompt is the template's rendering with the tools; the history's call arguments (a JSON string
    on the wire) are rendered as an object, the tool result inside `<tool_response>` tags."""
    response = chat(http, [ASKED, CALLED, ANSWERED], tools=[WEATHER])
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(response.json()["prompt_token_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description"' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in prompt
    )
    assert prompt.endswith(
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    message = response.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(
        message["content"], str
    )  # a random model calls nothing


def test_without_tools_or_with_tool_choice_none_the_prompt_has_no_tools_section(http, tokenizer):
    for fields in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        response = chat(http, [ASKED], **fields)
        assert response.status_code == 200, response.text
        assert "# Tools" not in tokenizer.decode(response.json()["prompt_token_ids"])


def answer(server, tokenizer, text, parallel=True):
    return answered(server, tokenizer, text, ToolUse([WEATHER], parallel))


def test_a_generated_call_is_answered_as_tool_calls(server, tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    choice = answer(server, tokenizer, f"Let me check.\n{call}<|im_end|>")
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    (tool_call,) = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    two = answer(server, tokenizer, f"{call}\n{call}<|im_end|>")["message"]
    assert two["content"] is None and len(two["tool_calls"]) == 2
    assert (
        len(answer(server, tokenizer, f"{call}\n{call}<|im_end|>", parallel=False)["message"]["tool_calls"])
        == 1
    )


def test_a_call_that_does_not_parse_is_plain_content_and_counted(server, tokenizer):
    failures = server.tool_calls.parse_failures
    choice = answer(server, tokenizer, '<tool_call>\n{"name": get_weather\n</tool_call><|im_end|>')
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert '{"name": get_weather' in choice["message"]["content"]
    assert server.tool_calls.parse_failures == failures + 1
    text = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call><|im_end|>'
    assert "tool_calls" not in answer(server, tokenizer, text)["message"]  # arguments not an object
    assert server.tool_calls.parse_failures == failures + 2
    assert answer(server, tokenizer, "Sunny.<|im_end|>")["message"]["content"] == "Sunny."
    assert server.tool_calls.parse_failures == failures + 2  # text without a call is no failure


@pytest.mark.parametrize(
    ("messages", "fields", "text"),
    [
        (
            [ASKED],
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "'x'",
        ),
        ([ASKED], {"tool_choice": "auto"}, "only allowed with tools"),
        ([ASKED, CALLED, {**ANSWERED, "tool_call_id": "call_9"}], {"tools": [WEATHER]}, "'call_9'"),
        ([ASKED, {**ANSWERED}], {"tools": [WEATHER]}, "answers no tool call"),
        (
            [ASKED],
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
        ),
        (
            [
                ASKED,
                {
                    **CALLED,
                    "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}],
                },
            ],
            {"tools": [WEATHER]},
            "messages[1].tool_calls[0].function.arguments is not JSON",
        ),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "only text parts"),
        (
            [ASKED],
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "table"}}}],
                "tool_choice": "required",
            },
            'cannot constrain a call: Unsupported type "table"',
        ),
    ],
    ids=[
        "unknown-named-function",
        "choice-without-tools",
        "unmatched-call-id",
        "tool-before-any-call",
        "tool-without-name",
        "arguments-not-json",
        "image-part",
        "schema-without-grammar",
    ],
)
def test_inconsistent_tool_requests_are_a_400_naming_what_is_wrong(http, messages, fields, text):
    response = chat(http, messages, **fields)
    assert response.status_code == 400, response.text
    assert text in response.json()["error"]["message"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("choice", "opening"),
    [("required", "<tool_call>\n"), (NAMED, '<tool_call>\n{"name": "get_weather", "arguments":')],
    ids=["required", "named"],
)
def test_a_constrained_tool_choice_opens_the_call_and_the_model_completes_it_token_exact(
    http, tokenizer, choice, opening
):
    """`required` / a named function: the call's opening follows the prompt (prompt ids, not answer ids),
    the model writes the rest, and opening + answer are the template's tokens of the whole call."""
    response = chat(http, [ASKED], tools=[WEATHER], tool_choice=choice, max_tokens=64, temperature=0)
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = render(tokenizer, [ASKED])
    assert body["prompt_token_ids"] == prompt + tokenizer.encode(opening)
    (choice_,) = body["choices"]
    assert choice_["finish_reason"] == "tool_calls"
    assert choice_["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert body["prompt_token_ids"][len(prompt) :] + choice_["token_ids"] == tokenizer.encode(
        CALL + "<|im_end|>"
    )


def test_a_named_function_is_answered_with_one_call(server):
    body = {"model": MODEL, "messages": [ASKED], "tools": [WEATHER]}
    for choice, parallel in ((None, True), ("required", True), (NAMED, False)):
        _, use = server._chat_request(ChatCompletionRequest.model_validate({**body, "tool_choice": choice}))
        assert use.parallel == parallel


def test_a_parser_without_a_known_call_format_refuses_a_constrained_tool_choice(tokenizer):
    calls = ToolCalls(tokenizer, "llama3_json")
    assert calls.use([WEATHER], "auto", True) == ToolUse([WEATHER], True)
    with pytest.raises(ToolRequestError, match=r"tool_parser='llama3_json' has none \(known: \['hermes'\]\)"):
        calls.use([WEATHER], "required", True)


TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def matcher(tokenizer, use):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    return xgr.GrammarMatcher(compiler.compile_grammar(use.grammar))


def template_call(tokenizer, tools, calls, use):
    """The template's tokens of an assistant message making `calls`, after the opening `use` writes."""
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ],
    }
    prompt = tokenizer.apply_chat_template(
        [ASKED], tools=tools, add_generation_prompt=True, return_dict=False
    )
    full = tokenizer.apply_chat_template([ASKED, message], tools=tools, return_dict=False)
    opening = tokenizer.encode(use.opening)
    assert full[len(prompt) : len(prompt) + len(opening)] == opening
    return full[len(prompt) + len(opening) :]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one-call"])
def test_the_required_grammar_admits_the_templates_calls_and_nothing_else(tokenizer, parallel):
    """The grammar of `required` admits, token for token, what the template renders for calls to the
    offered tools, up to the end-of-turn token; more calls only with `parallel`; no unknown function or
    argument."""
    tools = [WEATHER, TIME]
    use = ToolCalls(tokenizer, "hermes").use(tools, "required", parallel)
    tokens = template_call(tokenizer, tools, [("get_weather", {"city": "Paris"}), ("get_time", {})], use)
    end = tokens.index(tokenizer.convert_tokens_to_ids("</tool_call>")) + 1  # the first call's end
    m = matcher(tokenizer, use)
    assert all(m.accept_token(t) for t in tokens[:end])
    assert not m.is_terminated()
    if parallel:
        assert all(m.accept_token(t) for t in tokens[end:-1]) and m.is_terminated()  # -1: after <|im_end|>
    else:
        assert not m.accept_token(tokens[end])  # "\n" opening a second call
        assert m.accept_token(tokenizer.convert_tokens_to_ids("<|im_end|>")) and m.is_terminated()
    for wrong in (
        '{"name": "get_date", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"town": "X"}}',
    ):
        assert not matcher(tokenizer, use).accept_string(wrong)


def test_the_named_grammar_admits_that_functions_arguments(tokenizer):
    use = ToolCalls(tokenizer, "hermes").use([WEATHER, TIME], NAMED, True)
    assert use.opening == '<tool_call>\n{"name": "get_weather", "arguments":' and not use.parallel
    tokens = template_call(tokenizer, [WEATHER, TIME], [("get_weather", {"city": "Rome"})], use)
    m = matcher(tokenizer, use)
    assert all(m.accept_token(t) for t in tokens[:-1]) and m.is_terminated()
    assert not matcher(tokenizer, use).accept_string(' {"city": 3}')


def test_a_constrained_answer_is_read_as_its_calls_when_an_argument_holds_the_end_tag(tokenizer):
    """The grammar admits any JSON string, `</tool_call>` included (a greedy answer in CI wrote one): the
    answer is read as the calls the grammar made it, not cut at the first end tag."""
    calls = ToolCalls(tokenizer, "hermes")
    arguments = {"city": "}me</tool_call>en"}
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    text = f"{call}\n{call}<|im_end|>"
    for parallel, n in ((True, 2), (False, 1)):
        parsed = calls.parse(text, text.removesuffix("<|im_end|>"), [WEATHER], parallel, constrained=True)
        assert parsed.content is None
        assert [c["function"] for c in parsed.tool_calls] == [
            {"name": "get_weather", "arguments": arguments}
        ] * n
    cut = call[: call.index("}me")]  # max_tokens cut it: no whole call, so plain content
    assert not calls.parse(cut, cut, [WEATHER], True, constrained=True).tool_calls


def test_a_constrained_tool_choice_is_a_call_where_the_model_would_answer_text(http):
    """Given the tool's result the model answers text (memorised); constrained, it makes a call, with
    arguments its schema allows."""
    messages = [ASKED, CALLED, ANSWERED]
    assert (
        chat(http, messages, tools=[WEATHER], max_tokens=16, temperature=0).json()["choices"][0]["message"][
            "content"
        ]
        == REPLY
    )
    for choice in ("required", NAMED):
        response = chat(
            http,
            messages,
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=128,
            temperature=0,
        )
        assert response.status_code == 200, response.text
        (answer_,) = response.json()["choices"]
        assert answer_["finish_reason"] == "tool_calls", answer_
        (call,) = answer_["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert list(json.loads(call["function"]["arguments"])) == ["city"]


def test_text_content_parts_are_joined(http, tokenizer):
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]
    response = chat(http, [{"role": "user", "content": parts}])
    assert response.status_code == 200, response.text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in tokenizer.decode(
        response.json()["prompt_token_ids"]
    )
    assert json.loads(json.dumps(response.json()))  # the answer is plain JSON


@pytest.fixture
def openai_client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_the_model_calls_the_tool_and_the_openai_client_reads_the_call(openai_client):
    fields = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "max_tokens": 64}
    choice = openai_client.chat.completions.create(messages=[ASKED], **fields).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    result = {**ANSWERED, "tool_call_id": call.id}
    again = openai_client.chat.completions.create(messages=[ASKED, choice.message, result], **fields)
    assert (again.choices[0].message.content, again.choices[0].finish_reason) == (REPLY, "stop")


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["text", "tools"])
def test_a_streamed_answer_is_the_same_answer_in_openais_chunks(openai_client, tools):
    fields = {"model": MODEL, "messages": [ASKED], "temperature": 0, "max_tokens": 64}
    if tools:
        fields["tools"] = tools
    whole = openai_client.chat.completions.create(**fields).choices[0]
    chunks = list(
        openai_client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    choices = [c.choices[0] for c in chunks[:-1]]
    calls = [call for c in choices for call in c.delta.tool_calls or ()]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [whole.finish_reason]
    assert "".join(c.delta.content or "" for c in choices) == (whole.message.content or "")
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.message.tool_calls or ())
    ]
    assert (whole.finish_reason == "tool_calls" and len(calls) == 1) if tools else not calls


def test_a_streamed_completion_and_an_error_before_the_stream(http):
    body = {"model": MODEL, "prompt": "Weather", "max_tokens": 3, "stream": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["object"] == "text_completion" for c in chunks)
    bad = http.post("/v1/completions", json={**body, "model": "other"})  # before the first byte: plain JSON
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("choice", "opening"),
    [("auto", ""), (NAMED, '<tool_call>\n{"name": "get_weather", "arguments":')],
    ids=["auto", "named"],
)
def test_a_tool_session_is_recorded_as_generated_and_continued_token_for_token(
    server, tokenizer, openai_client, choice, opening
):
    """An agent's session through the endpoint: the call's turn records the generated tags (with a named
    tool choice the call's opening is context), and the request with the tool result continues that
    context token for token, which is also how the template renders the whole conversation (Qwen2.5's
    template is append-only for tool turns)."""
    sessions = AgentSessions(tokenizer, max_input_length=1024)
    server.recorder = sessions
    try:
        session = sessions.open("weather/0", SamplingParams(temperature=0.0, max_tokens=64))
        fields = {"model": MODEL, "tools": [WEATHER], "extra_headers": {"X-Session-Id": session}}
        message = (
            openai_client.chat.completions.create(messages=[ASKED], tool_choice=choice, **fields)
            .choices[0]
            .message
        )
        result = {**ANSWERED, "tool_call_id": message.tool_calls[0].id}
        second = openai_client.chat.completions.create(messages=[ASKED, message, result], **fields)
        assert second.choices[0].message.content == REPLY
        turns = sessions.close(session)
    finally:
        server.recorder = None
    assert tokenizer.decode(turns[0].context_ids).endswith("<|im_start|>assistant\n" + opening)
    assert opening + tokenizer.decode(turns[0].response_ids) == CALL + "<|im_end|>"
    assert prefix_consistent(Trajectory("weather", "weather/0", turns))
    assert turns[1].context_ids == render(tokenizer, [ASKED, CALLED, ANSWERED])


def test_a_call_the_template_would_render_differently_is_rendered_afresh(tokenizer):
    """The rendered-prefix check: a generated call whose JSON the template writes another way (spacing)
    is not continued; the next request is rendered as the template writes the conversation."""
    sessions = AgentSessions(tokenizer, max_input_length=1024)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    tools = [ToolDefinition.model_validate(WEATHER).model_dump(exclude_none=True)]
    asked, called_and_answered = template_messages([ASKED]), template_messages([ASKED, CALLED, ANSWERED])
    answer = called_and_answered[1]
    for call, continued in ((CALL, True), (CALL.replace('": "Paris"', '":"Paris"'), False)):
        session = sessions.open("weather/0", params)
        prompt, _ = sessions.prepare(session, None, asked, params, 1, tools)
        response = tokenizer.encode(call + "<|im_end|>")
        sessions.record(
            session, prompt, asked, [GenerationOutput(response, [0.0] * len(response), "stop", 0)], [answer]
        )
        following, _ = sessions.prepare(session, None, called_and_answered, params, 1, tools)
        assert (following[: len(prompt) + len(response)] == prompt + response) == continued
        if not continued:
            assert following == render(tokenizer, [ASKED, CALLED, ANSWERED])
        sessions.close(session)


class WeatherEnv(BaseTextEnv):
    """The weather game with a tool: call `get_weather`, then answer with the temperature (reward 1)."""

    def tools(self):
        return [WEATHER]

    def step(self, action, tool_calls=None):
        if tool_calls:
            results = [{"role": "tool", "tool_call_id": c["id"], "content": "18C"} for c in tool_calls]
            assert [c["function"]["arguments"] for c in tool_calls] == [{"city": "Paris"}]
            return BaseTextEnvStepOutput(results, 0.0, False)
        return BaseTextEnvStepOutput([], float("18C" in action), True)


async def weather_agent(row, info: ClientInfo) -> AgentResult:
    """The same game played by an agent with the `openai` client's function calling."""
    client = openai.AsyncOpenAI(base_url=info.base_url, api_key=info.api_key, default_headers=info.headers)
    messages = list(row.prompt)
    for _ in range(3):
        response = await client.chat.completions.create(model=info.model, messages=messages, tools=[WEATHER])
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return AgentResult(reward=float("18C" in (message.content or "")))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "18C"} for c in message.tool_calls]
    return AgentResult(reward=0.0)


async def weather_responses_agent(row, info: ClientInfo) -> AgentResult:
    """The same game through the Responses API: the response's output items go back with the results."""
    client = info.openai_client()
    items = list(row.prompt)
    for _ in range(3):
        response = await client.responses.create(
            model=info.model, input=items, tools=[RESPONSES_WEATHER], extra_headers=info.headers
        )
        items += [item.model_dump(exclude_unset=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return AgentResult(reward=float("18C" in response.output_text))
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "18C"} for c in calls]
    return AgentResult(reward=0.0)


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.mark.parametrize("agent", ["weather_agent", "weather_responses_agent"], ids=["chat", "responses"])
def test_a_tool_env_and_a_tool_agent_play_the_same_game_token_for_token(served, tokenizer, agent):
    """The env path (tools declared by the env, calls parsed for it) and the agent path (the openai
    client's function calling through the endpoint, on chat completions or the Responses API) give the
    same trajectories: the generated call, the tool result rendered by the template, the answer; both
    continued token for token."""
    loop, server = served
    here = __name__
    env = EnvironmentConfig(f"{here}:WeatherEnv")
    settings = {"n_samples_per_prompt": 2, "max_turns": 3, "max_generate_length": 64}
    rows = [PromptRow(0, [ASKED])]
    greedy = SamplingConfig(temperature=0.0)
    ours = loop.run(
        RolloutManager(server.client, tokenizer, GeneratorConfig(**settings), env).agenerate(
            rows, None, greedy
        )
    )
    agents = AgentGenerator(server, tokenizer, GeneratorConfig(**settings, agent=f"{here}:{agent}"), env)
    try:
        theirs = loop.run(agents.agenerate(rows, None, greedy))
    finally:
        agents.close()
        server.recorder = None
    for result in (ours, theirs):
        assert [e.reward for e in result.episodes] == [1.0, 1.0]
        assert result.metrics["episode/prefix_consistent_fraction"] == 1.0
        assert result.metrics["agent/tool_parse_failures"] == 0.0
    for a, b in zip(ours.episodes, theirs.episodes, strict=True):
        assert [(t.context_ids, t.response_ids) for t in a.trajectory.turns] == [
            (t.context_ids, t.response_ids) for t in b.trajectory.turns
        ]
        first, second = a.trajectory.turns
        assert tokenizer.decode(first.response_ids) == CALL + "<|im_end|>"
        assert second.context_ids == render(tokenizer, [ASKED, CALLED, ANSWERED])


def test_a_streamed_response_is_the_same_response_in_named_events(openai_client):
    fields = {"model": MODEL, "tools": [RESPONSES_WEATHER], "temperature": 0, "max_output_tokens": 64}
    whole = openai_client.responses.create(input=[ASKED], **fields)
    events = list(openai_client.responses.create(input=[ASKED], stream=True, **fields))
    assert [e.type for e in events[:2]] == ["response.created", "response.output_item.added"]
    assert events[-1].type == "response.completed" and whole.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (call,) = whole.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
    assert [(i.type, i.name, i.arguments) for i in events[-1].response.output] == [
        (call.type, call.name, call.arguments)
    ]
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert arguments == [call.arguments]
    items = [
        ASKED,
        call.model_dump(exclude_unset=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
    ]
    answer = openai_client.responses.create(input=items, **fields)
    events = list(openai_client.responses.create(input=items, stream=True, **fields))
    assert answer.output_text == REPLY and answer.output[0].type == "message"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert events[-1].response.output_text == REPLY


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id: responses are not stored here"),
        (
            {"input": [{"type": "image_generation_call", "id": "ig_1"}]},
            "input[0] has type 'image_generation_call'; this endpoint serves",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
        ),
        ({"tool_choice": {"type": "function", "name": "get_time"}}, "not among the tools"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "18C"}]},
            "tool_call_id='call_9'",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "w", "schema": {}}}},
            "text.format='json_schema': structured output is not served",
        ),
    ],
    ids=[
        "previous-response",
        "unknown-item",
        "image-part",
        "unknown-function",
        "unmatched-call-id",
        "structured",
    ],
)
def test_responses_requests_we_cannot_serve_are_a_400_naming_why(http, fields, text):
    body = {"model": MODEL, "input": [ASKED], "tools": [RESPONSES_WEATHER], **fields}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert text in response.json()["error"]["message"]


def test_a_response_cut_by_max_output_tokens_is_incomplete(http):
    body = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "max_output_tokens": 2,
        "temperature": None,
        "top_p": None,
    }
    response = http.post("/v1/responses", json=body).json()
    assert (response["status"], response["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert response["usage"]["output_tokens"] == len(response["token_ids"]) == 2
