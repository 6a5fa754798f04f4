"""rollsafe: durable, lossless checkpoint and restore of an async RL run's rollout state."""

__version__ = "0.1.0"
