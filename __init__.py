"""mixq: mixed-precision EXL3 / GGUF quantization of glm5_next MoE checkpoints, with fidelity measurement.

    import mixq
    res = mixq.convert("glm5next-mini", "mini.gguf", mixq.GGUFOptions(qtype="Q4_K_M"))
    report = mixq.verify(res.out)

Every name of `mixq.api.__all__` (inspect, plan, measure, convert, verify, evaluate, ...) is a name of `mixq`,
loaded on first use so that `import mixq` stays light.
"""

__version__ = "0.1.0"

from mixq.errors import FormatError, InputError, MixqError, PlanError  # noqa: E402
from mixq import convert  # noqa: E402  (the package is callable: mixq.convert(model, out, options))
from mixq.convert import ConvertResult, Exl3Options, GGUFOptions, verify  # noqa: E402

_API = ("inspect", "plan", "measure", "evaluate", "compare", "imatrix", "output_format", "options_for", "family",
        "card")

__all__ = ["convert", "verify", "Exl3Options", "GGUFOptions", "ConvertResult", "MixqError", "InputError",
           "PlanError", "FormatError", "__version__", *_API]


def __getattr__(name: str):
    """The façade's functions (mixq.api), imported when first asked for (it brings torch and transformers)."""
    if name in _API:
        from mixq import api

        return getattr(api, name)
    raise AttributeError(f"module 'mixq' has no attribute {name!r}")
