"""A run: objectives, rollouts and rewards, evaluation, the schedule, the run folder, the Trainer, the recipe entry
point."""
