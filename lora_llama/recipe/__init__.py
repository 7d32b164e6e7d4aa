"""The recipe: its schema, overrides and validation, and the reference generated from it."""
