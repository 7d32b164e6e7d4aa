"""The frozen base held in fewer bits: int8 and nf4 formats, GGUF's block formats, the quantized linear."""
