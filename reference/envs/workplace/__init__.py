"""The workplace environment: a multi-turn calendar tool environment, deterministic and small.

Each episode gets its own calendar (a sandbox), asks the policy engine for one tool call per
turn, maps the generated tokens to a valid calendar action and applies it idempotently. See
:mod:`.calendar` (pure state and actions), :mod:`.env` (the hooks), :mod:`.faults` (test
switches) and :mod:`.serve` (the server).
"""

from rollsafe.reference.envs.workplace.calendar import Task
from rollsafe.reference.envs.workplace.env import WorkplaceEnv

__all__ = ["Task", "WorkplaceEnv"]
