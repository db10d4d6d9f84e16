"""OpenAI function calling on the endpoint, over a tiny model whose tokenizer carries Qwen2.5's real chat
template (its tools system section, `<tool_call>` / `<tool_response>` tags as single tokens) and vLLM's
hermes parser, with a real HTTP client and a real hf engine."""

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.tools import ToolCalls
from skyrl.train.schema import OpenAIServerConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.tiny_model import create_tiny_model

from .conftest import serving

QWEN25_TEMPLATE = Path(__file__).parents[2] / "fixtures" / "qwen2_5_chat_template.jinja"
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
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


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return create_tiny_model(
        tmp_path_factory.mktemp("qwen-tools"), chat_template=QWEN25_TEMPLATE.read_text(), added_tokens=TAGS
    )


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def server(ray_cluster, model_path):
    with serving(model_path, OpenAIServerConfig(port=0, served_model_name=MODEL)) as server:
        yield server


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
    """What the endpoint answers for an engine output whose tokens are `text`."""
    out = GenerationOutput(tokenizer.encode(text), None, "stop", 0)
    return server._chat_choice(
        0, out, server._answer(out, SamplingParams(max_tokens=64), [WEATHER], parallel)
    )


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
    assert answer(server, tokenizer, "Sunny.<|im_end|>")["message"]["content"] == "Sunny."
    assert server.tool_calls.parse_failures == failures + 1  # text without a call is no failure


@pytest.mark.parametrize(
    ("messages", "fields", "text"),
    [
        (
            [ASKED],
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "'x'",
        ),
        ([ASKED], {"tools": [WEATHER], "tool_choice": "required"}, "constrained decoding"),
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
    ],
    ids=[
        "unknown-named-function",
        "required",
        "choice-without-tools",
        "unmatched-call-id",
        "tool-before-any-call",
        "tool-without-name",
        "arguments-not-json",
        "image-part",
    ],
)
def test_inconsistent_tool_requests_are_a_400_naming_what_is_wrong(http, messages, fields, text):
    response = chat(http, messages, **fields)
    assert response.status_code == 400, response.text
    assert text in response.json()["error"]["message"]


def test_text_content_parts_are_joined(http, tokenizer):
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]
    response = chat(http, [{"role": "user", "content": parts}])
    assert response.status_code == 200, response.text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in tokenizer.decode(
        response.json()["prompt_token_ids"]
    )
    assert json.loads(json.dumps(response.json()))  # the answer is plain JSON
