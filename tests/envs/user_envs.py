"""Environments defined outside skyrl, referenced as 'tests.envs.user_envs:Class'."""

from skyrl.envs import BaseTextEnv, BaseTextEnvStepOutput


class EchoLengthEnv(BaseTextEnv):
    """Reward = number of characters of the answer, one turn."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput([], float(len(action)), True)


class NotAnEnv:
    pass
