"""Reward functions for end-to-end tests (`algo.reward_funcs=[tests.rewards:NAME]`), in TRL's signature."""


def length_reward(prompts, completions, completion_ids, **columns):
    """Each completion's length: a dense reward, so a random-init model's groups have spread and its RL
    steps train (the task's verifier scores such a model 0 everywhere, and every step would be empty)."""
    return [float(len(c)) for c in completions]


def target_reward(completions, target, **kwargs):
    """1 where the completion holds the row's `target` column (a TRL-style function reading a data set column),
    plus a small length term so a random-init model's groups spread."""
    return [float(t in c) + 0.01 * len(c) for c, t in zip(completions, target)]
