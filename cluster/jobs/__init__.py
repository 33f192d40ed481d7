"""The jobs: rollout, train (sync and async), eval, sft and score, with what they measure and show."""
