"""Every llama-quantize type name as `--type`, byte-identical to llama-quantize: mixq's `--rounding exact` file vs
llama.cpp's quantizer (llama-cpp-python 0.3.36, `llama_model_quantize` on mixq's own BF16 GGUF of k256, with mixq's
importance matrix), every tensor's ggml type and bytes, and the file type. Slow: one conversion per mix.

The imatrix has no entries for the NextN block (as llama-imatrix's), and llama-quantize refuses the very-low-bit
types without one, so a mix that would put such a type on a NextN tensor is compared without the block (--no-mtp on
both sides). Set MIXQ_LQ_NAMES_RESULTS to a file to append one JSON line per case (bench/quality/llama_quantize_names).
"""
from __future__ import annotations

import ctypes
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")

from gguf import GGUFReader  # noqa: E402

from mixq.conversion.gguf.pipeline import collect_imatrix, convert_gguf  # noqa: E402
from mixq.formats.imatrix_file import read_imatrix, write_imatrix  # noqa: E402
from mixq.planning import gguf_mix as gm  # noqa: E402
from mixq.planning.planner import plan_model  # noqa: E402

RESULTS = os.environ.get("MIXQ_LQ_NAMES_RESULTS")
# the K-quant mixes and Q8_0 that --type took before the other llama-quantize names: run last
EARLIER = ("Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
WRITABLE = tuple(m for m in gm.MIX_NAMES if gm.has_encoder(gm.MIX_DEFAULT[m]))
# with mixq's imatrix: every mix takes one, and the very-low-bit ones need it. (The mixes whose rules read whether
# an imatrix is given, IQ3_XXS / IQ4_NL / IQ4_XS / Q4_0 / Q5_0, differ only in layers below n_layer/8: none on k256.)
# cheapest encoders first within each group, so that a stopped run has the most cases
_COST = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K_S", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "IQ3_XS", "IQ3_XXS", "IQ2_M",
         "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
CASES = [(m, True) for m in sorted(WRITABLE, key=lambda m: (m in EARLIER, _COST.index(m) if m in _COST else 0))]


@pytest.fixture(scope="module")
def work(k256_model, calibration_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("lq-names")
    imx = d / "k256.imatrix.gguf"
    write_imatrix(imx, collect_imatrix(k256_model, [calibration_text], rows=8, seq_len=256, device="cpu",
                                       progress=False))
    bf16 = {}
    for mtp in (True, False):
        bf16[mtp] = d / f"bf16-{'mtp' if mtp else 'nomtp'}.gguf"
        convert_gguf(k256_model, bf16[mtp], qtype="BF16", include_mtp=mtp, progress=False)
    return d, imx, bf16


def _llama_quantize(src, dst, ftype: int, imx) -> int:
    """llama.cpp's quantizer through the C API; the imatrix as llama-quantize hands it over (Σx²/count per column)."""
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = ftype, 2
    keep = []
    if imx is not None:
        means = read_imatrix(imx).means()
        arr = (llama_cpp.llama_model_imatrix_data * (len(means) + 1))()
        for i, (name, m) in enumerate(sorted(means.items())):
            v = np.ascontiguousarray(np.asarray(m, dtype=np.float32).reshape(-1))
            keep.append((name.encode(), v))
            arr[i].name = keep[-1][0]
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))


def _differ(a, b) -> list[str]:
    ta = {t.name: t for t in GGUFReader(a).tensors}
    tb = {t.name: t for t in GGUFReader(b).tensors}
    out = sorted(set(ta) ^ set(tb))
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or not np.array_equal(np.asarray(x.data).view(np.uint8).reshape(-1),
                                                                np.asarray(y.data).view(np.uint8).reshape(-1)):
            out.append(n)
    return out


def _file_type(path) -> int:
    f = GGUFReader(path).fields["general.file_type"]
    return int(f.parts[f.data[0]][0])


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mix,with_imatrix", CASES, ids=[f"{m}-{'imx' if i else 'plain'}" for m, i in CASES])
def test_exact_file_equals_llama_quantize(mix, with_imatrix, k256_model, work):
    d, imx, bf16 = work
    names = set(read_imatrix(imx).means())
    plan = plan_model(k256_model, "gguf", qtype=mix, imatrix_given=with_imatrix)
    # the NextN block stays out where its tensors would need importance data the imatrix does not have
    mtp = not any(gm.requires_imatrix(t.type, t.name, mix) and t.name not in names for t in plan.tensors)
    tag = f"{mix}-{'imx' if with_imatrix else 'plain'}"
    theirs, ours = d / f"llama-{tag}.gguf", d / f"mixq-{tag}.gguf"
    rc = _llama_quantize(bf16[mtp], theirs, gm.MIXES[mix].file_type, imx if with_imatrix else None)
    assert rc == 0
    convert_gguf(k256_model, ours, qtype=mix, include_mtp=mtp, imatrix=str(imx) if with_imatrix else None,
                 rounding="exact", progress=False)
    differ = _differ(ours, theirs)
    types = sorted({t.tensor_type.name for t in GGUFReader(ours).tensors})
    rec = dict(mix=mix, imatrix=with_imatrix, nextn=mtp, tensors=len(GGUFReader(ours).tensors), differ=len(differ),
               names=differ[:10], types=types, file_type=[_file_type(ours), _file_type(theirs)])
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(rec) + "\n")
    for p in (ours, theirs):
        p.unlink()
    assert not differ, rec
    assert rec["file_type"][0] == rec["file_type"][1] == gm.MIXES[mix].file_type, rec
