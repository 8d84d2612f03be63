"""Rollouts: one generation round (`ContinuousBatchingGenerator`) and async rollouts across training steps."""
