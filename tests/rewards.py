"""Reward functions for end-to-end tests (`algo.reward_fn=tests.rewards:NAME`)."""


def length_reward(example, completion):
    """The completion's length: a dense reward, so a random-init model's groups have spread and its RL
    steps train (the task's verifier scores such a model 0 everywhere, and every step would be empty)."""
    return float(len(completion))
