"""`zerokl ppo`: PPO with the zero-KL check every step, as a pipeline of stages run by one orchestrator (`loop`).

rollout (`rollouts`: single-turn, episodes, rollouts queued ahead) -> check (`check`: the zero-KL check and its
diagnosis) -> advantages (`advantages`: GRPO, GAE) -> update (`update`: minibatches, micro-batches, losses) -> sync
(`sync`: versioned weight or adapter sync, servers) and state (`state`: checkpoints, resume); `samples` holds the plain
data they pass, `setup` what a run checks before it starts, `metrics` a step's metrics line, `algo` the PPO math.
"""
