"""mixq: mixed-precision EXL3 / GGUF quantization of glm5_next MoE checkpoints, with fidelity measurement.

    import mixq
    res = mixq.convert("glm5next-mini", "mini.gguf", mixq.GGUFOptions(qtype="Q4_K_M"))
    report = mixq.verify(res.out)
"""

__version__ = "0.1.0"

from mixq.errors import FormatError, InputError, MixqError, PlanError  # noqa: E402
from mixq import convert  # noqa: E402  (the package is callable: mixq.convert(model, out, options))
from mixq.convert import ConvertResult, Exl3Options, GGUFOptions, verify  # noqa: E402

__all__ = ["convert", "verify", "Exl3Options", "GGUFOptions", "ConvertResult", "MixqError", "InputError",
           "PlanError", "FormatError", "__version__"]
