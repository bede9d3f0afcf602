"""Reward functions of the tiny-grpo example (`trl.reward_funcs: [tiny_grpo_rewards.even_tokens]`).

Each is called with the prompts, the completions, the completion token ids and the dataset's other columns (here
`topic`) as keywords, and returns one score per completion (docs/rl.md)."""


def even_tokens(prompts, completions, completion_ids, **kwargs):
    """The share of completion tokens whose id is even: about half at the start, a reward the built-in tiny model
    can learn in a minute on a CPU."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]
