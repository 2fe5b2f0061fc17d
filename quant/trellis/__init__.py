"""mixq.quant.trellis: the QTIP-style trellis of EXL3, bit-compatible with exllamav3.

The random-sign Hadamard rotation (`hadamard`), the codebooks (`codebooks`), the Viterbi search (`viterbi`; its
Triton kernel `viterbi_triton`), LDLQ feedback (`ldlq`) and the Linear encoder on top (`encoder`), plus the
Hessian-weighted loss curves that `plan --measure` reads (`loss`). The package's own names are the encoder's:
`quantize`, `quantize_with_stats`, `QuantizedLinear`, `from_tensors`, `pad_to`, `PAD`.
"""
from .encoder import (PAD, SCALE_PRIOR, QuantizedLinear, TrellisStats, check_inputs, from_tensors, pad_to, quantize,
                      quantize_with_stats)

__all__ = ["PAD", "SCALE_PRIOR", "QuantizedLinear", "TrellisStats", "check_inputs", "from_tensors", "pad_to", "quantize",
           "quantize_with_stats"]
