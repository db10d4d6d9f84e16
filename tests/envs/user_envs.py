"""Environments defined outside skyrl, referenced as 'tests.envs.user_envs:Class'."""

import ctypes
import os
import threading

from skyrl.envs import BaseTextEnv, BaseTextEnvStepOutput


class EchoLengthEnv(BaseTextEnv):
    """Reward = number of characters of the answer, one turn."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput([], float(len(action)), True)


class NotAnEnv:
    pass


class OwnInitEnv(EchoLengthEnv):
    """An EchoLengthEnv with a constructor of its own."""

    def __init__(self, env_config=None, extras=None):
        super().__init__(env_config, extras)


class ChattyEnv(BaseTextEnv):
    """Answers every turn with "Again.", done after `env_config['turns']` turns with reward 1."""

    def __init__(self, env_config=None, extras=None):
        super().__init__(env_config, extras)
        self.turns = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= int(self.env_config.get("turns", 3))
        observations = [] if done else [{"role": "user", "content": "Again."}]
        return BaseTextEnvStepOutput(observations, 1.0 if done else 0.0, done)


class FlakyEnv(ChattyEnv):
    """A ChattyEnv that raises on its second step when the row's `fail` column is true."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.extras.get("fail") and self.turns == 1:
            raise RuntimeError("simulated env crash")
        return super().step(action)


RELEASE = threading.Event()  # wakes HangingEnv's blocked steps
FINISHED: list[str] = []  # the blocked steps that returned


class HangingEnv(ChattyEnv):
    """A ChattyEnv whose steps block (up to 30 s, until `RELEASE`) when the row's `hang` column is true."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.extras.get("hang"):
            RELEASE.wait(30)
            FINISHED.append(action)
        return super().step(action)


class StuckEnv(BaseTextEnv):
    """One turn, reward 1; the step never returns when the row's `stuck` column is true."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.extras.get("stuck"):
            threading.Event().wait()
        return BaseTextEnvStepOutput([], 1.0, True)


class CrashingEnv(ChattyEnv):
    """A ChattyEnv whose process dies on its second step as the row's `crash` column says: `exit`
    (`os._exit(3)`) or `segfault` (a read of address 0). Only for `generator.env_executor=process`."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.turns == 1 and self.extras.get("crash") == "exit":
            os._exit(3)
        if self.turns == 1 and self.extras.get("crash") == "segfault":
            ctypes.string_at(0)
        return super().step(action)


class UnpicklableMetricsEnv(EchoLengthEnv):
    """Its metrics hold a function, which cannot travel back from an env process."""

    def get_metrics(self) -> dict:
        return {"score": lambda: 0}
