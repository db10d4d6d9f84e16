"""A reasoning model's thinking on the endpoint (`generator.http_endpoint.reasoning_parser`), over a tiny
model that has memorised a thinking answer (`<think>` / `</think>` single tokens, as Qwen3's), with vLLM's
`qwen3` reasoning parser, the `openai` client and a real hf engine."""

import openai
import pytest
from transformers import AutoTokenizer

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput
from skyrl.train.dataset.preprocess import Trajectory, prefix_consistent
from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.agent import AgentSessions
from skyrl.train.generator.rollout import RolloutManager
from skyrl.train.inference.engine import SamplingParams
from skyrl.train.inference.reasoning import Reasoning
from skyrl.train.inference.tools import ToolUse
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, OpenAIServerConfig, SamplingConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.utils.tiny_tools_model import TOOL_TAGS

from .conftest import answered, memorise, serving

MODEL = "thinker"
# A Qwen3-like template, short: an assistant turn's `reasoning_content` inside <think> tags before its content
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASKED = {"role": "user", "content": "Umbrella?"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
THOUGHT, REPLY = "It rains in Paris.", "Take one."
ANSWER = f"<think>\n{THOUGHT}\n</think>\n\n{REPLY}"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = create_tiny_model(
        tmp_path_factory.mktemp("thinker"),
        chat_template=TEMPLATE,
        added_tokens=("<think>", "</think>", *TOOL_TAGS),
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [ASKED], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    memorise(path, [(prompt, tokenizer.encode(ANSWER + "<|im_end|>"))])
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


ENDPOINT = OpenAIServerConfig(port=0, served_model_name=MODEL, tool_parser="hermes", reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def served(ray_cluster, model_path):
    with serving(model_path, ENDPOINT) as served:
        yield served


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_an_unknown_parser_or_one_the_tokenizer_cannot_serve_is_a_config_error(tokenizer, tiny_model_path):
    with pytest.raises(ConfigError, match=r"generator.http_endpoint.reasoning_parser='nope' .*'qwen3'"):
        Reasoning(tokenizer, "nope")
    with pytest.raises(ConfigError, match=r"reasoning_parser='deepseek_r1' cannot parse .*think"):
        Reasoning(AutoTokenizer.from_pretrained(tiny_model_path), "deepseek_r1")  # no <think> token
    assert Reasoning(tokenizer, "none").split(ANSWER) == (None, ANSWER)


def test_the_thinking_is_answered_as_reasoning_apart_from_the_content(client, tokenizer):
    fields = {"model": MODEL, "messages": [ASKED], "temperature": 0, "max_tokens": 32}
    message = client.chat.completions.create(**fields).choices[0].message
    assert (message.reasoning.strip(), message.content.strip()) == (THOUGHT, REPLY)
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**fields, stream=True)]
    assert "".join(getattr(d, "reasoning", None) or "" for d in chunks) == message.reasoning
    assert "".join(d.content or "" for d in chunks) == message.content
    prompt = tokenizer.apply_chat_template([ASKED], add_generation_prompt=True, tokenize=False)
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=32)
    assert completion.choices[0].text == ANSWER  # a completion is the text as generated


def test_an_answer_sent_back_with_its_reasoning_continues_the_session_token_for_token(
    server, tokenizer, client
):
    """The assistant message as returned (with `reasoning`) reaches the template as `reasoning_content`;
    this template renders it as generated, so the next request continues the recorded tokens."""
    sessions = AgentSessions(tokenizer, max_input_length=1024)
    server.recorder = sessions
    try:
        session = sessions.open("umbrella/0", SamplingParams(temperature=0.0, max_tokens=32))
        fields = {"model": MODEL, "extra_headers": {"X-Session-Id": session}}
        message = client.chat.completions.create(messages=[ASKED], **fields).choices[0].message
        again = [ASKED, message, {"role": "user", "content": "Thanks."}]
        prompt_ids = client.chat.completions.create(messages=again, **fields).model_extra["prompt_token_ids"]
        turns = sessions.close(session)
    finally:
        server.recorder = None
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>" in tokenizer.decode(prompt_ids)
    assert prefix_consistent(Trajectory("umbrella", "umbrella/0", turns))


def test_the_responses_api_answers_the_thinking_as_a_reasoning_item_and_continues_on_it(
    server, tokenizer, client
):
    sessions = AgentSessions(tokenizer, max_input_length=1024)
    server.recorder = sessions
    try:
        session = sessions.open("umbrella/1", SamplingParams(temperature=0.0, max_tokens=32))
        fields = {"model": MODEL, "extra_headers": {"X-Session-Id": session}}
        response = client.responses.create(input=[ASKED], **fields)
        thought, said = response.output
        assert (thought.type, thought.content[0].text.strip()) == ("reasoning", THOUGHT)
        assert (said.type, response.output_text.strip()) == ("message", REPLY)
        items = [ASKED, *(i.model_dump(exclude_unset=True) for i in response.output)]
        again = client.responses.create(input=[*items, {"role": "user", "content": "Thanks."}], **fields)
        turns = sessions.close(session)
    finally:
        server.recorder = None
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>" in tokenizer.decode(
        again.model_extra["prompt_token_ids"]
    )
    assert prefix_consistent(Trajectory("umbrella", "umbrella/1", turns))


def answer(server, tokenizer, text: str, opening: str = "") -> dict:
    return answered(server, tokenizer, text, ToolUse([WEATHER], True, opening))


def test_calls_are_parsed_from_the_content_the_parser_leaves(server, tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    called = answer(server, tokenizer, f"<think>\nCheck.\n</think>\n\n{call}<|im_end|>")
    assert called["finish_reason"] == "tool_calls" and called["message"]["reasoning"] == "\nCheck.\n"
    assert called["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # a constrained tool choice writes the call's opening after the prompt: the answer is the call, no thinking
    forced = answer(server, tokenizer, call.removeprefix("<tool_call>\n") + "<|im_end|>", "<tool_call>\n")
    assert forced["finish_reason"] == "tool_calls" and "reasoning" not in forced["message"]
    qwen3, server.reasoning = server.reasoning, Reasoning(tokenizer, "deepseek_r1")
    try:  # deepseek_r1 keeps a call written inside <think> as thinking (qwen3 ends the thinking at it)
        thought = answer(server, tokenizer, f"<think>\nMaybe {call}\n</think>\n\nNo.<|im_end|>")
    finally:
        server.reasoning = qwen3
    assert thought["finish_reason"] == "stop" and "tool_calls" not in thought["message"]
    assert call in thought["message"]["reasoning"] and thought["message"]["content"] == "\n\nNo."


class ReplyEnv(BaseTextEnv):
    """One turn: reward 1 when the action is the reply alone."""

    def step(self, action, tool_calls=None):
        return BaseTextEnvStepOutput([], float(action.strip() == REPLY), True)


def test_an_env_steps_on_the_content_the_parser_leaves_and_the_thinking_is_trained(served, tokenizer):
    loop, server = served
    cfg = GeneratorConfig(n_samples_per_prompt=1, max_turns=1, max_generate_length=32, http_endpoint=ENDPOINT)
    manager = RolloutManager(server.client, tokenizer, cfg, EnvironmentConfig(f"{__name__}:ReplyEnv"))
    out = loop.run(manager.agenerate([PromptRow(0, [ASKED])], None, SamplingConfig(temperature=0.0)))
    (episode,) = out.episodes
    assert episode.reward == 1.0, "the env got the reply without the thinking"
    assert tokenizer.decode(episode.trajectory.turns[0].response_ids) == ANSWER + "<|im_end|>"
