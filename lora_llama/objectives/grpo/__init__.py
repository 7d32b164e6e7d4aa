"""GRPO: the objective (objective.py), its rollouts, rewards and tools (with trl's environments)."""
