"""Models from their sources (HF folders, GGUF, Hub ids, registered names), PEFT adapter files, fsdp's sharded
loading."""
