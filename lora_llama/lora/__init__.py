"""Low-rank adapters: their settings, how they start, the layer that wraps a frozen linear, and the embedding
rows trained beside them."""
