"""Records to token ids: chat templates, SFT examples, preference pairs, GRPO prompts."""
