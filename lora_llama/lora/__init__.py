"""Low-rank adapters: their settings, how they start, and the layer that wraps a frozen linear."""
