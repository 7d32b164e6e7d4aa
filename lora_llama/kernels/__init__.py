"""Tensor-level forward and backward pieces: products, attention, elementwise ops, cross-entropy, buffers.

They know tensors, not models."""
