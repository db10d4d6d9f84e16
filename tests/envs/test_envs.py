import pytest

from skyrl.envs import (
    BaseTextEnv,
    BaseTextEnvStepOutput,
    calculator,
    guess_number,
    make,
    register,
    registered_names,
    resolve,
)
from skyrl.envs.math_env import answers_match, extract_answer
from tests.envs.user_envs import EchoLengthEnv

# ---- registry ----


def test_builtins_are_registered():
    assert {"guess_number", "math", "calculator", "chat"} <= set(registered_names())


def test_chat_is_one_turn_without_a_reward_of_its_own():
    env = make("chat", {}, {})
    messages, _ = env.init([{"role": "user", "content": "Hi."}])
    assert messages == [{"role": "user", "content": "Hi."}]
    assert env.step("Hello!") == BaseTextEnvStepOutput([], 0.0, True)


def test_module_class_entry_point_is_imported():
    env = make("tests.envs.user_envs:EchoLengthEnv", {}, {})
    assert isinstance(env, EchoLengthEnv)
    assert env.step("abcd").reward == 4.0


def test_register_a_user_env_by_class_and_by_string():
    register("echo_len", EchoLengthEnv)
    register("echo_len_str", "tests.envs.user_envs:EchoLengthEnv")
    assert resolve("echo_len") is EchoLengthEnv is resolve("echo_len_str")


def test_unknown_name_lists_registered_envs():
    with pytest.raises(ValueError, match=r"unknown environment 'sokoban'; registered: \[.*'guess_number'"):
        make("sokoban")


def test_class_that_is_not_a_text_env_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"not a skyrl.envs.BaseTextEnv subclass; registered environments"):
        resolve("tests.envs.user_envs:NotAnEnv")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve("no_such_module:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        resolve("tests.envs.user_envs:Missing")


def test_base_env_defaults_pass_the_prompt_through():
    class Minimal(BaseTextEnv):
        def step(self, action):
            return BaseTextEnvStepOutput([], 0.0, True)

    env = Minimal(None, None)
    prompt = [{"role": "user", "content": "hi"}]
    assert env.init(prompt) == (prompt, {})
    assert env.get_metrics() == {}
    env.close()


# ---- guess_number ----


def test_guess_number_answers_higher_lower_and_rewards_the_right_guess():
    env = make("guess_number", {"max_turns": 4}, {"target": 5})
    assert env.step("3").observations == [{"role": "user", "content": "Higher."}]
    assert env.step("I say 7").observations == [{"role": "user", "content": "Lower."}]
    out = env.step("5")
    assert (out.reward, out.done) == (1.0, True)
    assert env.get_metrics() == {"guesses": 3.0}


def test_guess_number_ends_after_max_turns_with_optional_shaping():
    plain = make("guess_number", {"max_turns": 2}, {"target": 8})
    plain.step("1")
    assert (plain.step("2").reward, plain._consolation(2)) == (0.0, 0.0)
    shaped = make(
        "guess_number", {"max_turns": 1, "shaped": True, "min_value": 1, "max_value": 8}, {"target": 8}
    )
    out = shaped.step("7")
    assert out.done and out.reward == pytest.approx(0.5 * (1 - 1 / 7))


def test_guess_number_without_a_number_ends_with_an_error():
    out = make("guess_number", {}, {"target": 2}).step("banana")
    assert out.done and out.reward == 0.0 and "no number" in out.metadata["error"]


def test_guess_number_needs_a_target():
    with pytest.raises(ValueError, match="'target' column"):
        make("guess_number", {}, {})


def test_guess_number_dataset_is_deterministic_and_in_range():
    rows = guess_number.make_dataset(50, seed=3, min_value=1, max_value=8)
    assert rows == guess_number.make_dataset(50, seed=3, min_value=1, max_value=8)
    assert rows != guess_number.make_dataset(50, seed=4, min_value=1, max_value=8)
    assert {r["env_class"] for r in rows} == {"guess_number"}
    assert all(1 <= r["target"] <= 8 for r in rows)
    assert rows[0]["prompt"][0]["content"] == "Guess the hidden number between 1 and 8. Answer with a number."


# ---- math ----


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 6 * 7 = 42\n#### 42", "42"),
        ("The answer is \\boxed{3/4}.", "3/4"),
        ("#### 1 then later \\boxed{2}", "2"),
        ("no answer here", None),
    ],
)
def test_math_extracts_the_last_final_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("predicted", "truth", "match"),
    [
        ("1,234", "1234", True),
        ("$12.00", "12", True),
        ("0.75", "3/4", True),
        ("42.", "42", True),
        ("41", "42", False),
    ],
)
def test_math_compares_numbers_after_normalisation(predicted, truth, match):
    assert answers_match(predicted, truth) is match


def test_math_env_rewards_one_turn():
    assert make("math", {}, {"answer": 18}).step("#### 18").reward == 1.0
    wrong = make("math", {}, {"answer": 18}).step("#### 17")
    assert wrong.done and wrong.reward == 0.0
    assert "no final answer" in make("math", {}, {"answer": 18}).step("18").metadata["error"]


# ---- calculator ----


@pytest.mark.parametrize(
    ("expression", "value"), [("3 * (4 + 5)", 27), ("-2 ** 3", -8), ("7 // 2 + 7 % 2", 4), ("1 / 4", 0.25)]
)
def test_safe_eval_computes_arithmetic(expression, value):
    assert calculator.safe_eval(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("2 ** 10000", "exponent"),
        ("1 / 0", "division by zero"),
        ("10 ** 40", "out of range"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_safe_eval_refuses_everything_else(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator.safe_eval(expression)


def test_calculator_episode_tool_call_then_answer():
    env = make("calculator", {"max_turns": 3}, {"answer": "27"})
    call = env.step("let me check <tool>3 * (4 + 5)</tool>")
    assert call.observations == [{"role": "user", "content": "<result>27</result>"}] and not call.done
    bad = env.step("<tool>1/0</tool>")
    assert bad.observations[0]["content"] == "<result>error: division by zero</result>"
    final = env.step("<answer>27</answer>")
    assert (final.reward, final.done) == (1.0, True)
    assert env.get_metrics() == {"tool_calls": 2.0}


def test_calculator_ends_at_max_turns_and_on_unparseable_actions():
    env = make("calculator", {"max_turns": 1}, {"answer": "1"})
    assert env.step("<tool>1</tool>").done
    out = make("calculator", {}, {"answer": "1"}).step("hmm")
    assert out.done and out.reward == 0.0 and "error" in out.metadata


def test_calculator_dataset_answers_are_correct_and_deterministic():
    rows = calculator.make_dataset(20, seed=1)
    assert rows == calculator.make_dataset(20, seed=1)
    for row in rows:
        expression = row["prompt"][1]["content"]
        assert row["answer"] == calculator.format_number(calculator.safe_eval(expression))


def test_calculator_with_function_calling_declares_its_tool_and_answers_calls_as_tool_messages():
    env = make("calculator", {"function_calling": True}, {"answer": "27"})
    (tool,) = env.tools()
    assert tool["function"]["name"] == "calculator"
    assert tool["function"]["parameters"]["required"] == ["expression"]
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}},
        },
        {"id": "b", "type": "function", "function": {"name": "search", "arguments": {}}},
        {
            "id": "c",
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "1/0"}},
        },
    ]
    out = env.step("", calls)
    assert [(m["role"], m["tool_call_id"]) for m in out.observations] == [
        ("tool", "a"),
        ("tool", "b"),
        ("tool", "c"),
    ]
    assert [m["content"] for m in out.observations] == [
        "27",
        "error: no tool 'search'; the tool is 'calculator'",
        "error: division by zero",
    ]
    assert not out.done and env.get_metrics() == {"tool_calls": 3.0}
    assert (
        env.step("<tool>1</tool>", []).metadata["error"]
        == "neither a calculator call nor <answer>...</answer>"
    )
    assert make("calculator", {}, {"answer": "1"}).tools() is None  # the text protocol by default
    rows = calculator.make_dataset(2, seed=1, function_calling=True)
    assert (
        "<tool>" not in rows[0]["prompt"][0]["content"]
        and rows[0]["answer"] == calculator.make_dataset(2, 1)[0]["answer"]
    )
