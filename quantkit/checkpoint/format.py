"""Names shared by the checkpoint writer and readers: files, tensor suffixes, layout tags.

A small leaf module so that :mod:`quantkit.checkpoint.save` (writing), :mod:`quantkit.checkpoint.read`
and :mod:`quantkit.checkpoint.inspect` (reading) agree on them without importing each other.
"""

from __future__ import annotations

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Where AutoGPTQ and GPTQModel write their settings beside config.json (GPTQModel reads them in this
# order, before config.json's quantization_config).
QUANTIZE_CONFIG_NAMES = ("quantize_config.json", "quant_config.json")
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")

# In-memory and written layout tags.
LAYOUT = "gptq_v1"  # quantkit.pack's GPTQ layout, zero points stored minus one
LAYOUT_GPTQ_V2 = "gptq_v2"  # GPTQModel's v2: the same bit order, zero points stored as they are
LAYOUT_AWQ_GEMM = "awq_gemm"  # AutoAWQ's GEMM layout (quantkit.pack, AWQ section)

# dtypes of the packed tensors in every layout quantkit reads.
PACKED_DTYPES = {
    "qweight": torch.int32,
    "qzeros": torch.int32,
    "g_idx": torch.int32,
    "scales": torch.float16,
}
