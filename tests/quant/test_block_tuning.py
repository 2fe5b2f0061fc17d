"""quant/ggml/rounding/block_tuning.py: ggml codes as a differentiable parameter on their encoded grid, and the
signed descent (glm5next-k256 weights, encoded by mixq's exact ggml encoders)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from triton_helpers import interpret

from mixq.errors import InputError
from mixq.quant.ggml.rounding import block_tuning as bt
from mixq.quant.ggml.rounding import levels as gl
from mixq.quant.ggml import encoders


@pytest.fixture(scope="module")
def weights(k256_model):
    from mixq.formats.checkpoint import open_checkpoint

    ck = open_checkpoint(k256_model)
    return ck.get("model.language_model.layers.0.mlp.down_proj.weight", dtype=torch.float32)[:48, :512].contiguous()


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS"])
def test_codes_start_at_the_encoding(weights, qtype):
    """Untouched, the relaxation decodes to exactly the encoded weights and writes back the same bytes; each u
    sits within half a step of its code, towards the source weight."""
    blocks = encoders.quantize(weights.numpy(), qtype)
    c = bt.LevelCodes(blocks, qtype, weights)
    ref = gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype])
    assert torch.allclose(c.dequantized().detach(), torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    assert np.array_equal(c.blocks(), blocks)
    assert c.changed() == 0.0
    gap = (c.u.detach() - c.start).abs()
    assert float(gap.max()) <= bt.START_REACH + 1e-6 and float(gap.mean()) > 0.05


def _layer_loss(weights, x, codes):
    y = x @ weights.T
    return lambda sl: ((x[sl] @ codes.dequantized().T - y[sl]) ** 2).mean()


# per type: block bytes, and the byte ranges outside the codes (Q2_K: 16 scale bytes, d, dmin; IQ4_NL: d; IQ4_XS:
# d, scales_h, scales_l)
_KEPT_BYTES = {"Q2_K": (84, [(0, 16), (80, 84)]), "IQ4_NL": (18, [(0, 2)]), "IQ4_XS": (136, [(0, 8)])}


@pytest.mark.parametrize("qtype", list(_KEPT_BYTES))
def test_sign_descent_lowers_a_held_out_loss_and_keeps_the_scales(weights, qtype):
    """The codes of a tensor tuned for a Linear's output on correlated inputs: the held-out loss falls, some
    codes move, and every byte outside the codes (scales, mins, super-scales) stays. IQ4_NL's non-uniform levels
    are relaxed through their piecewise-linear interpolation."""
    g = torch.Generator().manual_seed(0)
    mix = 3.0 * torch.randn(512, 512, generator=g) / 512 ** 0.5 + torch.eye(512)
    x = torch.randn(640, 512, generator=g) @ mix
    blocks = encoders.quantize(weights.numpy(), qtype)
    codes = bt.LevelCodes(blocks, qtype, weights)
    loss = _layer_loss(weights, x, codes)
    fit = [slice(i, i + 64) for i in range(0, 512, 64)]
    held = slice(512, 640)
    with torch.no_grad():
        start = float(loss(held))
    first, best = bt.sign_descent([codes.u], loss, fit, 40, 0.5, score=lambda: float(loss(held).detach()))
    assert first == pytest.approx(start) and best < 0.95 * start
    with torch.no_grad():
        assert float(loss(held)) == pytest.approx(best)
    assert 0.01 < codes.changed() < 0.5
    out = codes.blocks()
    assert out.shape == blocks.shape
    size, kept = _KEPT_BYTES[qtype]
    o, b = out.reshape(-1, size), blocks.reshape(-1, size)
    assert all(np.array_equal(o[:, i:j], b[:, i:j]) for i, j in kept)
    assert not np.array_equal(out, blocks)


def test_sign_descent_returns_to_the_start_when_nothing_scores_better(weights):
    """A held-out score that every move makes worse: the parameters end where they started."""
    blocks = encoders.quantize(weights.numpy(), "Q4_K")
    codes = bt.LevelCodes(blocks, "Q4_K", weights)
    u0 = codes.u.detach().clone()
    loss = lambda _sl: (codes.dequantized() - 1.0).square().mean()  # noqa: E731  (pulls every code upward)
    score = lambda: float((codes.u.detach() - u0).abs().sum())  # noqa: E731  (0 only at the start)
    first, best = bt.sign_descent([codes.u], loss, [None], 10, 1.0, score=score)
    assert first == best == 0.0
    assert torch.equal(codes.u.detach(), u0) and np.array_equal(codes.blocks(), blocks)


def test_sign_descent_takes_a_known_start_score(weights):
    """A stage that starts where the one before ended passes that score: the start is not scored again, and a
    start that scores best still ends the descent there."""
    blocks = encoders.quantize(weights.numpy(), "Q4_K")
    codes = bt.LevelCodes(blocks, "Q4_K", weights)
    u0 = codes.u.detach().clone()
    loss = lambda _sl: (codes.dequantized() - 1.0).square().mean()  # noqa: E731
    calls = []
    score = lambda: calls.append(1) or 1.0 + float((codes.u.detach() - u0).abs().sum())  # noqa: E731
    first, best = bt.sign_descent([codes.u], loss, [None], 8, 1.0, score=score, checks=4, start=0.5)
    assert len(calls) == 4 and first == best == 0.5
    assert torch.equal(codes.u.detach(), u0)


def _iq2(weights, qtype):
    """IQ2 blocks of `weights` by ggml's encoder (IQ2_XS needs an importance: the weights' mean square per column)."""
    return encoders.quantize(weights.numpy(), qtype, (weights * weights).mean(0).numpy() + 1e-8)


def test_tunable_types_are_the_level_grid_types_and_iq2(weights):
    assert set(bt.TUNABLE) == set(gl.SCALAR_TYPES) | {"IQ2_S", "IQ2_XS"}
    assert isinstance(bt.tunable_codes(encoders.quantize(weights.numpy(), "Q4_K"), "Q4_K", weights), bt.LevelCodes)
    for qtype in ("IQ2_S", "IQ2_XS"):
        blocks = _iq2(weights, qtype)
        assert isinstance(bt.tunable_codes(blocks, qtype, weights), bt.IQ2Codes)
        with pytest.raises(InputError):
            bt.tunable_codes(blocks, qtype, weights, scales=True)  # the IQ2 types' scales are not learned


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_codes_start_at_the_encoding(weights, qtype):
    """Untouched, an IQ2 relaxation decodes to gguf-py's values of the encoded blocks and writes back the same
    bytes; each u lies on the signed table, within START_REACH of its encoded position, towards the source."""
    blocks = _iq2(weights, qtype)
    c = bt.IQ2Codes(blocks, qtype, weights)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype]))
    assert c.u.shape == weights.shape and torch.allclose(c.dequantized().detach(), ref, rtol=1e-6, atol=1e-7)
    assert np.array_equal(c.blocks(), blocks) and c.changed() == 0.0
    start = c._positions(c.index0, c.signs0).reshape(weights.shape)
    gap = (c.u.detach() - start).abs()
    assert float(gap.max()) <= bt.START_REACH + 1e-6 and float(gap.mean()) > 0.05
    assert float(c.u.detach().min()) >= 0 and float(c.u.detach().max()) <= 5


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_groups_off_the_codebook_take_the_nearest_entry(weights, qtype):
    """A group whose rounded magnitudes are no codebook tuple decodes to the codebook entry nearest to its
    interpolated values (a brute-force search over all the entries), with their signs; one whose rounded
    magnitudes are a tuple decodes to it. IQ2_XS: a group with an odd count of negatives flips the one weight of
    least |relaxed value| x magnitude, and every stored sign pattern is even."""
    c = bt.IQ2Codes(_iq2(weights, qtype), qtype, weights)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        c.u.copy_(torch.rand(c.u.shape, generator=g) * 5)
    levels = torch.from_numpy(gl.iq2_levels(qtype))
    grid = torch.from_numpy(gl.iq2_grid(qtype))
    soft = gl.table_values(c.u.detach(), levels).reshape(-1, 8)
    rounded = levels[torch.round(c.u.detach()).long()].reshape(-1, 8)
    on_grid = (rounded.abs().unsqueeze(1) == grid).all(-1)               # (groups, entries)
    nearest = torch.cdist(soft.abs(), grid).argmin(-1)
    want = torch.where(on_grid.any(-1), on_grid.float().argmax(-1), nearest)
    index, signs = c.codes()
    assert 0 < float(on_grid.any(-1).float().mean()) < 1  # both cases occur
    assert torch.equal(index.reshape(-1), want)
    neg = soft < 0
    if qtype == "IQ2_XS":
        odd = neg.sum(-1) % 2 == 1
        assert 0 < float(odd.float().mean()) < 1
        flip = (soft.abs() * grid[want]).argmin(-1)
        neg[odd, flip[odd]] = ~neg[odd, flip[odd]]
        assert bool((neg.sum(-1) % 2 == 0).all())
    bits = (signs.reshape(-1, 1) >> torch.arange(8)) & 1
    assert torch.equal(bits.bool(), neg)
    db = torch.from_numpy(gl.iq2_group_scales(c.source, qtype)).reshape(-1, 1)
    assert torch.equal(c.dequantized().detach().reshape(-1, 8), db * grid[want] * torch.where(neg, -1.0, 1.0))
    stored = gl.iq2_groups(c.blocks(), qtype)[1]  # the sign bytes read back from the written blocks
    assert np.array_equal(stored.reshape(-1), signs.numpy().reshape(-1))


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_neighbour_search_finds_the_nearest_entries(weights, qtype):
    """The search near each group's best tuple answers as scoring every entry does, on values around codebook
    entries (as a descent leaves them) and anywhere on the table, except where the two answers' exact scores
    tie within float32 rounding; it settles most groups near the magnitudes without scoring every entry."""
    c = bt.IQ2Codes(_iq2(weights, qtype), qtype, weights)
    g = torch.Generator().manual_seed(2)
    n = 60000
    grid = torch.from_numpy(gl.iq2_grid(qtype)).double()
    around = grid.float()[torch.randint(0, grid.shape[0], (n,), generator=g)] + torch.randn(n, 8, generator=g) * 4
    anywhere = (torch.rand(n, 8, generator=g) - 0.5) * 100
    for target in (around, anywhere):
        scored, seen = c.scored_entries(target), []
        full = c.scored_entries
        c.scored_entries = lambda t: (seen.append(t.shape[0]), full(t))[1]
        near = c.neighbour_entries(target)
        del c.scored_entries
        differ = near != scored
        t = target[differ].abs().double()
        gap = [((grid[i] ** 2).sum(-1) - 2 * (t * grid[i]).sum(-1)) for i in (near[differ], scored[differ])]
        assert int(differ.sum()) <= 20 and bool(((gap[0] - gap[1]).abs() < 1e-2).all())
        if target is around:
            assert 0 < sum(seen) < n / 2
    assert c.nearest_entries(around).equal(c.neighbour_entries(around) if qtype in bt.IQ2_NEIGHBOUR_TYPES
                                           else c.scored_entries(around))
    assert c.neighbour_entries(around[:0]).shape == (0,)


def _search_gaps(c, target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """How many groups two searches answer differently, and the largest gap of their exact scores there."""
    grid = c.grid.double()
    differ = a != b
    t = target[differ].abs().double()
    gap = [((grid[i] ** 2).sum(-1) - 2 * (t * grid[i]).sum(-1)) for i in (a[differ], b[differ])]
    return int(differ.sum()), float((gap[0] - gap[1]).abs().max()) if int(differ.sum()) else 0.0


_FUSED_CHECK = """
import json, sys
import numpy as np, torch
from mixq.quant.ggml import encoders
from mixq.quant.ggml.rounding import block_tuning as bt
from mixq.quant.ggml.rounding import levels as gl
bt.FUSED_DECODE_CHECK_GROUPS = 64  # the interpreter runs one op at a time
g = torch.Generator().manual_seed(3)
w = torch.randn(4, 256, generator=g) * 0.02
out = {}
for qtype in sys.argv[1:]:
    blocks = encoders.quantize(w.numpy(), qtype, (w * w).mean(0).numpy() + 1e-8)
    c = bt.IQ2Codes(blocks, qtype, w)
    grid = c.grid
    t = grid[torch.randint(0, grid.shape[0], (96,), generator=g)] + torch.randn(96, 8, generator=g) * 4
    t = torch.cat([t, (torch.rand(32, 8, generator=g) - 0.5) * 100])
    res = [bt.use_fused(t), c.nearest_entries(t).tolist() == c.scored_entries(t).tolist(),
           c.fused_entries(t[:0]).shape[0]]
    start = c.dequantized()
    res.append(bt.FUSED_DECODE[(qtype, "cpu")] and torch.equal(start, torch.from_numpy(
        gl.decode_blocks(blocks, qtype, "cpu").numpy()).reshape(start.shape)))
    with torch.no_grad():
        c.u.add_(torch.randn(c.u.shape, generator=g) * 0.7)
    fused = c.dequantized()
    moved = c.blocks()
    written = gl.decode_blocks(moved, qtype, "cpu").reshape(fused.shape)
    fused.sum().backward()
    grad = c.u.grad.clone()
    c.u.grad = None
    bt.FUSED_DECODE[(qtype, "cpu")] = False
    eager = c.dequantized()
    eager.sum().backward()
    res += [torch.equal(fused.detach(), written), float((fused != eager).view(-1, 8).any(-1).float().mean()),
            torch.equal(grad, c.u.grad), float((moved != blocks).mean()) > 0]
    out[qtype] = res
print(json.dumps(out))
"""


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_fused_search_and_decode_in_the_interpreter(qtype):
    """The fused codebook search and the one-kernel decode (Triton, here in its interpreter on the CPU) serve
    where they run: the search answers as scoring every entry does; the decode passes its first-use check, starts
    at the encoded values, decodes moved codes as the eager decode does (ties aside) with the same gradient, and
    the written blocks hold exactly the values the decode gave."""
    out = interpret(_FUSED_CHECK, qtype, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(res) == [qtype]
    fused, same_search, empty, start, written, differ, same_grad, moved = res[qtype]
    assert fused and same_search and empty == 0, qtype
    assert start and written and differ <= 0.01 and same_grad and moved, (qtype, differ)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_fused_search_and_decode_on_the_gpu(qtype):
    """On a GPU the fused codebook search answers as scoring every entry does except where the two exact scores
    tie within float32 rounding; the one-kernel decode passes its first-use check and decodes moved codes as the
    eager decode does (ties aside), with the same gradient; the written blocks hold exactly its values."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(4)
    weights = torch.randn(64, 2048, generator=g) * 0.02  # no fixture: the device copy carries none
    blocks = _iq2(weights, qtype)
    c = bt.IQ2Codes(blocks, qtype, weights, dev)
    n = 400000
    grid = c.grid.cpu()
    target = (grid[torch.randint(0, grid.shape[0], (n,), generator=g)] + torch.randn(n, 8, generator=g) * 4).to(dev)
    differ, gap = _search_gaps(c, target, c.fused_entries(target), c.scored_entries(target))
    assert differ <= n * 1e-4 and gap < 1e-2
    assert c.fused_decode_ok() and bt.use_fused(c.u)
    with torch.no_grad():
        c.u.add_(torch.randn(c.u.shape, generator=g).to(dev) * 0.6)
    fused = c.dequantized()
    fused.sum().backward()
    grad, c.u.grad = c.u.grad.clone(), None
    assert torch.equal(fused.detach(), gl.decode_blocks(c.blocks(), qtype, dev).reshape(fused.shape))
    key = (qtype, str(c.u.device))
    bt.FUSED_DECODE[key] = False
    try:
        eager = c.dequantized()
        eager.sum().backward()
    finally:
        bt.FUSED_DECODE[key] = True
    assert float((fused != eager).view(-1, 8).any(-1).float().mean()) < 1e-2  # ties within float32 rounding
    assert torch.equal(grad, c.u.grad)


@pytest.mark.parametrize("qtype", ["IQ2_S", "IQ2_XS"])
def test_iq2_sign_descent_lowers_a_held_out_loss_and_keeps_the_scales(weights, qtype):
    """An IQ2 type's codebook groups tuned for a Linear's output: the held-out loss falls, some groups move, the
    fp16 d and the 4-bit scales stay byte for byte, and the written blocks decode (gguf-py) to exactly the weights
    the loss saw."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 512, generator=g) @ (3.0 * torch.randn(512, 512, generator=g) / 512 ** 0.5 + torch.eye(512))
    blocks = _iq2(weights, qtype)
    codes = bt.tunable_codes(blocks, qtype, weights)
    loss = _layer_loss(weights, x, codes)
    with torch.no_grad():
        start = float(loss(slice(512, 640)))
    first, best = bt.sign_descent(codes.params, loss, [slice(i, i + 64) for i in range(0, 512, 64)], 40, 0.5,
                                  score=lambda: float(loss(slice(512, 640)).detach()))
    assert first == pytest.approx(start) and best < 0.95 * start
    assert 0.01 < codes.changed() < 0.9
    out = codes.blocks()
    assert out.shape == blocks.shape and not np.array_equal(out, blocks)
    layout = gl.IQ2_LAYOUTS[qtype]
    o, b = out.reshape(-1, layout.block_bytes), blocks.reshape(-1, layout.block_bytes)  # d: bytes 0-1
    assert np.array_equal(o[:, :2], b[:, :2])
    assert np.array_equal(o[:, layout.sub_scale_bytes], b[:, layout.sub_scale_bytes])
    got = torch.from_numpy(gguf_quants.dequantize(out, GGMLQuantizationType[qtype]))
    assert torch.equal(got, codes.dequantized().detach())


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_1", "IQ4_NL"])
def test_learned_scales_are_what_the_file_decodes_to(weights, qtype):
    """With scales learned, the relaxation starts at the encoding, and after the descent the written blocks (fp16
    scales, codes) decode through gguf-py to exactly the weights the loss saw."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 512, generator=g) @ (3.0 * torch.randn(512, 512, generator=g) / 512 ** 0.5 + torch.eye(512))
    blocks = encoders.quantize(weights.numpy(), qtype)
    codes = bt.LevelCodes(blocks, qtype, weights, scales=True)
    ref = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype]))
    assert torch.allclose(codes.dequantized().detach(), ref, rtol=1e-5, atol=1e-6)
    assert np.array_equal(codes.blocks(), blocks) and len(codes.params) == 2
    loss = _layer_loss(weights, x, codes)
    first, best = bt.sign_descent(codes.params, loss, [slice(i, i + 64) for i in range(0, 512, 64)], 40,
                                  [0.5, 0.2], score=lambda: float(loss(slice(512, 640)).detach()))
    assert best < first
    assert not torch.equal(codes.super_scales(), codes.sup0)
    got = torch.from_numpy(gguf_quants.dequantize(codes.blocks(), GGMLQuantizationType[qtype]))
    assert torch.allclose(got, codes.dequantized().detach(), rtol=1e-6, atol=1e-7)
