"""mixq.eval: KLD / top-1 / PPL of quantized candidates against the reference model, reports and plots.

Public API: `evaluate(...)` (eval/api.py) and `compare(...)` (eval/report.py); imported lazily so that
`import mixq.eval.family` (or any other light eval module) stays light.
"""
from __future__ import annotations


def evaluate(*args, **kwargs):
    """See `mixq.eval.api.evaluate`."""
    from mixq.eval.api import evaluate as _evaluate  # local: `import mixq.eval.family` stays light

    return _evaluate(*args, **kwargs)


def compare(*args, **kwargs):
    """See `mixq.eval.report.compare`."""
    from mixq.eval.report import compare as _compare  # local: `import mixq.eval.family` stays light

    return _compare(*args, **kwargs)
