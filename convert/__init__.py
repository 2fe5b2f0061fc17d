"""mixq.convert: plan, calibrate and drive conversions (EXL3, GGUF).

The package is also the `convert` verb: `import mixq; mixq.convert(model, out, options)` and
`from mixq.convert import convert` both run `mixq.convert.api.convert`.
"""
import sys as _sys
import types as _types

from .api import convert, verify
from .options import Exl3Options, GGUFOptions, options_for
from .result import ConvertResult


class _CallablePackage(_types.ModuleType):
    """A module type whose instances can be called (`mixq.convert(...)` runs a conversion)."""

    def __call__(self, model, out, options=None, **kwargs) -> ConvertResult:
        """`mixq.convert(model, out, ...)`: `mixq.convert.api.convert` (None: the format follows OUT)."""
        return convert(model, out, options, **kwargs)


# `mixq.convert` names both this package and the API verb; giving the package module a class with __call__ lets one
# name be both, while mixq.convert.pipeline & co. stay ordinary submodules.
_sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["convert", "verify", "Exl3Options", "GGUFOptions", "options_for", "ConvertResult"]
