"""Files on disk, by format: atomic outputs, JSON, tokenizer files, safetensors shards, checkpoint rows; format-level
(names, shapes, bytes), knowing nothing of models or LoRA."""
