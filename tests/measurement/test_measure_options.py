"""`mixq.measure` takes one typed options object (MeasureOptions), or its fields as keywords: every value is checked
when it is built, an unknown keyword is one InputError, and the curves it saves are those it returns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mixq
from mixq.errors import InputError
from mixq.formats.checkpoint import open_checkpoint
from mixq.measurement import trellis as cs


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "hessian"}, "--method 'hessian': expected one of kld, stream, trellis, proxy"),
    ({"fmt": "onnx"}, "--format 'onnx'"),
    ({"fmt": "gguf", "method": "trellis"}, "--method trellis is EXL3's"),
    ({"rounding": "hessian"}, "--rounding and --imatrix apply to a GGUF measurement"),
    ({"fmt": "gguf", "rounding": "nearest"}, "--rounding 'nearest'"),
    ({"sample": "0,2"}, "--measure-sample '0,2'"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"fmt": "gguf", "gguf_ladder": "x"}, "--gguf-ladder 'x'"),
])
def test_measure_options_are_checked_when_built(kwargs, message):
    with pytest.raises(InputError, match=message):
        mixq.MeasureOptions(**kwargs)


def test_values_are_parsed_once():
    o = mixq.MeasureOptions(fmt="GGUF", calibration="c.txt", sample="4,8", device="cpu", rounding="Hessian")
    assert (o.fmt, o.calibration, o.sample, o.device, o.rounding) == ("gguf", ("c.txt",), (4, 8),
                                                                       torch.device("cpu"), "hessian")
    assert mixq.MeasureOptions().method == "kld" and mixq.MeasureOptions().fmt == "exl3"
    assert mixq.MeasureOptions(fmt="gguf", method="stream").method == "stream"  # end to end, both formats


def test_unknown_keywords_and_both_forms_are_one_error(tmp_path):
    with pytest.raises(InputError, match="unknown measure options 'methd', 'outt'"):
        mixq.measure(tmp_path, "exl3", methd="kld", outt="x.json")
    with pytest.raises(InputError, match="as MeasureOptions or as keywords, not both"):
        mixq.measure(tmp_path, options=mixq.MeasureOptions(), method="proxy")
    with pytest.raises(InputError, match="expected MeasureOptions, not PlanOptions"):
        mixq.measure(tmp_path, options=mixq.PlanOptions())


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory) -> Path:
    """A 2-layer tiny checkpoint (KDA + dense MLP, KDA + 2 experts; no NextN, no vision)."""
    from mixq.formats.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny2") / "m", nextn=False, vision=False,
                                 layer_types=("linear_attention", "linear_attention"))


def test_measure_saves_what_it_returns_and_refuses_to_overwrite(tiny2, tmp_path):
    """The proxy curves of a tiny model: the file read back holds the returned curves and the method; a second run
    to the same file is refused without overwrite, before anything is measured."""
    out = tmp_path / "curves.json"
    curves = mixq.measure(tiny2, options=mixq.MeasureOptions(method="proxy", out=out, progress=False))
    assert set(curves) == set(cs.budget_units(open_checkpoint(tiny2)))
    assert all(c[2.0] > c[4.0] > 0 for c in curves.values())
    assert cs.load_curves(out) == curves
    assert json.loads(out.read_text())["_meta"] == {"model": str(tiny2), "method": "proxy"}
    with pytest.raises(InputError, match="--measure-out"):
        mixq.measure(tiny2, "exl3", method="proxy", out=out, progress=False)
