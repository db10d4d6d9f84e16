import pytest
import torch

from skyrl.train.algorithms import (
    compute_stepwise_advantages,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)

USER_MODULE = f"{__package__}.user_algos"


def test_user_estimator_given_as_module_function_is_imported_and_used():
    estimator = get_advantage_estimator(f"{USER_MODULE}:constant_advantage")
    mask = torch.tensor([[1, 1, 0]])
    advantages, _ = estimator(torch.zeros(1, 3), mask, ["p"], constant=3.0)
    torch.testing.assert_close(advantages, torch.tensor([[3.0, 3.0, 0.0]]))
    stepwise, _ = compute_stepwise_advantages(
        f"{USER_MODULE}:constant_advantage",
        torch.zeros(2, 3),
        torch.ones(2, 3),
        ["p", "p"],
        ["t", "t"],
        [False, True],
    )
    torch.testing.assert_close(stepwise, torch.full((2, 3), 2.0))


def test_user_policy_loss_given_as_module_function_is_imported_and_used():
    loss_fn = get_policy_loss(f"{USER_MODULE}:linear_policy_loss")
    log_probs = torch.tensor([[-1.0, -2.0]])
    loss, metrics = loss_fn(
        log_probs, log_probs, torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]), eps_clip_low=0.2
    )
    torch.testing.assert_close(loss, torch.tensor([[1.0, 0.0]]))
    assert metrics["mean_log_prob"].item() == -1.0


def test_importing_a_user_module_registers_its_decorated_estimator_by_name():
    estimator = get_advantage_estimator(f"{USER_MODULE}:negated_grpo")
    assert get_advantage_estimator("user_negated_grpo") is estimator
    rewards = torch.tensor([[1.0], [0.0]])
    advantages, _ = estimator(rewards, torch.ones_like(rewards), ["p", "p"], norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(advantages, torch.tensor([[-0.5], [0.5]]))


@pytest.mark.parametrize(
    ("getter", "builtins"),
    [
        (get_advantage_estimator, ["gae", "grpo", "reinforce++", "rloo"]),
        (get_policy_loss, ["cispo", "dual_clip", "gspo", "regular"]),
    ],
)
def test_unknown_name_raises_value_error_listing_the_builtins(getter, builtins):
    with pytest.raises(ValueError) as error:
        getter("no_such_algorithm")
    assert all(repr(name) in str(error.value) for name in builtins)


@pytest.mark.parametrize("name", ["no_such_package_xyz:fn", f"{USER_MODULE}:no_such_function"])
def test_unresolvable_module_function_raises_value_error(name):
    with pytest.raises(ValueError, match="no_such"):
        get_policy_loss(name)


def test_registering_a_taken_name_raises_instead_of_replacing_the_builtin():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("regular")(lambda *args, **kwargs: None)
    assert get_policy_loss("regular").__name__ == "ppo_clip_loss"
