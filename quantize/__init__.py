"""Quantize stage: GPTQ and AWQ (through gptqmodel), a round-to-nearest baseline, and a fidelity
report (KL, perplexity, top-1 agreement, size) of each quantized model vs full precision.

Entry point: `quantize.pipeline.run_quantization(config, model_dir, data_dir, out_root)`.
Only the light pieces are imported here; gptqmodel/transformers load when used.
"""

from quantize.config import QuantizeConfig
from quantize.errors import QuantizeError, QuantizeGateError

__all__ = ["QuantizeConfig", "QuantizeError", "QuantizeGateError"]
