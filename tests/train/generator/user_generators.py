"""Rollout systems defined outside skyrl, referenced as 'tests.train.generator.user_generators:Class'."""

import asyncio

from skyrl.train.dataset.preprocess import Trajectory, Turn
from skyrl.train.generator.rollout import Episode, GeneratorOutput, allowed_token_ids
from skyrl.train.inference.engine import SamplingParams


class OneTurn:
    """Guess the number in one go, straight on the engine client: reward 1 for the hidden number."""

    def __init__(self, client, tokenizer, cfg, env):
        self.client, self.tokenizer, self.cfg = client, tokenizer, cfg
        self.allowed = allowed_token_ids(tokenizer, env)

    async def agenerate(self, prompts, uids=None, sampling=None, n_samples_per_prompt=None):
        uids = uids or [f"p{i}" for i in range(len(prompts))]
        sampling = sampling or self.cfg.sampling
        n = n_samples_per_prompt or self.cfg.n_samples_per_prompt
        params = SamplingParams(
            temperature=sampling.temperature, max_tokens=1, allowed_token_ids=self.allowed
        )

        async def episode(row, uid, sample):
            ids = self.tokenizer.apply_chat_template(
                row.prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            out = await self.client.generate(ids, params, session_id=f"{uid}/{sample}")
            reward = float(self.tokenizer.decode(out.response_ids).strip() == str(row.extras["target"]))
            turn = Turn(
                list(ids), list(out.response_ids), list(out.logprobs), [1], reward, out.weight_version
            )
            return Episode(Trajectory(uid, f"{uid}/{sample}", [turn]), "done", reward)

        episodes = await asyncio.gather(
            *(episode(r, u, s) for r, u in zip(prompts, uids, strict=True) for s in range(n))
        )
        return GeneratorOutput(list(episodes), {})


class Short(OneTurn):
    """Forgets the last sample of every batch."""

    async def agenerate(self, prompts, uids=None, sampling=None, n_samples_per_prompt=None):
        out = await super().agenerate(prompts, uids, sampling, n_samples_per_prompt)
        return GeneratorOutput(out.episodes[:-1], out.metrics)
