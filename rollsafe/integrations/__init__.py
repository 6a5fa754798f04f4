"""Trainers a user already runs, taking the rollout source (rollsafe.source) through their own
seams, one module per trainer, each importing its library only there (an extra each):

- :mod:`rollsafe.integrations.trl`: TRL's GRPOTrainer (``pip install 'rollsafe[trl]'``).
"""
