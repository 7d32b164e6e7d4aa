"""What a training step minimises: one module per objective, found through catalog.py."""
