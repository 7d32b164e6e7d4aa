"""The quantized formats' names a user writes (`model.quantize`, `--quantize`), kept free of torch so the command
line's `--help` answers at once; each name's handler is in handlers.py."""

SETTINGS = ("int8", "nf4", "source")  # model.quantize's values: 8 bits, 4 bits, a GGUF base's own blocks
FROM_FLOAT = ("int8", "nf4")  # those quantized from float weights while the model loads
