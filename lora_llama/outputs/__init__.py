"""What a run's adapter becomes: a merged HF checkpoint, GGUF files, a Hub upload."""
