"""mixq: mixed-precision EXL3 / GGUF quantization of glm5_next MoE checkpoints, with fidelity measurement.

    import mixq
    res = mixq.convert("glm5next-mini", "mini.gguf", mixq.GGUFOptions(qtype="Q4_K_M"))
    report = mixq.verify(res.out)

Every name of `mixq.api.__all__` (inspect, plan, measure, convert, verify, evaluate, ...) is a name of `mixq`,
loaded on first use so that `import mixq` stays light.
"""

__version__ = "0.1.0"

from mixq.errors import FormatError, InputError, MixqError, MixqWarning, PlanError, escape  # noqa: E402

# the names of mixq.api.__all__ that are not the errors above (tests check the two lists agree)
_API = ("inspect", "plan", "measure", "convert", "family", "verify", "evaluate", "compare", "card", "imatrix",
        "demo", "output_format", "PlanOptions", "MeasureOptions", "EvalOptions", "ImatrixOptions", "Exl3Options",
        "GGUFOptions", "FamilyOptions", "options_for", "ConvertResult", "DEFAULT_WINDOWS",
        "format_report", "format_plan", "render_markdown", "format_demo")

__all__ = ["MixqError", "MixqWarning", "InputError", "PlanError", "FormatError", "escape", "__version__", *_API]


def __getattr__(name: str):
    """The façade's names (mixq.api), imported when first asked for (it brings torch and transformers)."""
    if name in _API:
        from mixq import api

        return getattr(api, name)
    raise AttributeError(f"module 'mixq' has no attribute {name!r}")
