"""The PPO loop with zero-KL checked every step."""
