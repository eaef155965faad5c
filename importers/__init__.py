"""Importers: published checkpoints -> the canonical config and weights (spec.param_shapes).

``import_huggingface(directory)`` reads a Hugging Face model directory (config.json and
model.safetensors) of a supported family — GPT-2, Marian, BART, Llama, Qwen2, Qwen3, Mistral, Phi-3,
Gemma 2, Gemma 3, the mixtures of experts Mixtral and Qwen3-MoE, and the hybrids Qwen3.5 and Qwen3-Next
(importers.huggingface.FAMILIES) — through one explicit mapping per family. It needs NumPy and
safetensors only; transformers is not imported.
"""

from importers.huggingface import FAMILIES, Imported, import_huggingface, import_to_file, require_import_of

__all__ = ["FAMILIES", "Imported", "import_huggingface", "import_to_file", "require_import_of"]
