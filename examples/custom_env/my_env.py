"""A user environment: say the word the prompt asks for. Lives outside skyrl; the config names it."""

from skyrl.envs import BaseTextEnv, BaseTextEnvStepOutput


class RepeatWordEnv(BaseTextEnv):
    """Reward 1 when the answer contains the requested word (dataset column `word`), else 0. One turn."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        hit = self.extras["word"] in action.lower()
        return BaseTextEnvStepOutput(observations=[], reward=1.0 if hit else 0.0, done=True)
