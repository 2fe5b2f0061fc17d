"""mmproj (glm5v) GGUF of the fixture's vision tower: every key and tensor llama.cpp's mtmd loader requires for
this projector (vendored tools/mtmd/clip.cpp / clip-impl.h), with the right types and values."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mixq.formats.checkpoint import open_checkpoint
from mixq.formats.gguf_reader import read_gguf
from mixq.formats.mmproj import write_mmproj

VT = gguf.GGUFValueType
# key -> (GGUF type, value on the fixture): what clip.cpp reads for PROJECTOR_TYPE_GLM5V
REQUIRED_KV = {
    "general.architecture": (VT.STRING, "clip"),
    "clip.projector_type": (VT.STRING, "glm5v"),
    "clip.has_vision_encoder": (VT.BOOL, True),
    "clip.use_silu": (VT.BOOL, True),
    "clip.vision.projection_dim": (VT.UINT32, 128),
    "clip.vision.image_size": (VT.UINT32, 336),
    "clip.vision.patch_size": (VT.UINT32, 14),
    "clip.vision.embedding_length": (VT.UINT32, 64),
    "clip.vision.feed_forward_length": (VT.UINT32, 128),
    "clip.vision.block_count": (VT.UINT32, 1),
    "clip.vision.attention.head_count": (VT.UINT32, 2),
    "clip.vision.spatial_merge_size": (VT.UINT32, 2),
    "clip.vision.swiglu_clamp": (VT.FLOAT32, 10.0),
    "clip.vision.image_min_pixels": (VT.UINT32, 16 * 28 * 28),
    "clip.vision.image_max_pixels": (VT.UINT32, 8000 * 28 * 28),
}
# tensors the loader fetches as required for glm5v (the rest are optional there but present in the tower)
REQUIRED_TENSORS = ["v.blk.0.attn_out.weight", "v.blk.0.ffn_up.weight", "v.blk.0.ffn_down.weight",
                    "mm.model.fc.weight", "mm.up.weight", "mm.gate.weight", "mm.down.weight", "mm.post_norm.weight",
                    "mm.patch_merger.weight", "mm.patch_merger.bias", "v.patch_embd.weight", "v.patch_embd.weight.1"]


@pytest.mark.parametrize("outtype", ["F16", "Q8_0"])
def test_mmproj_keys_and_tensors(mini_model, tmp_path, outtype):
    out = tmp_path / "mmproj.gguf"
    s = write_mmproj(mini_model, out, outtype, progress=False)
    r = gguf.GGUFReader(out)
    for key, (vt, val) in REQUIRED_KV.items():
        f = r.fields[key]
        assert VT(f.types[0]) == vt, key
        got = f.contents()
        assert (abs(got - val) < 1e-6) if isinstance(val, float) else got == val, key
    assert VT(r.fields["clip.vision.image_mean"].types[1]) == VT.FLOAT32
    assert r.fields["clip.vision.attention.layer_norm_epsilon"].contents() == pytest.approx(1e-5)
    g = read_gguf(out)
    assert set(REQUIRED_TENSORS) <= set(g.tensors) and s["tensors"] == len(g.tensors) == 26
    assert all(g.tensors[n].qtype == "F32" for n in g.tensors if n.endswith(".bias") or "norm" in n or ".ln" in n)
    assert g.tensors["mm.up.weight"].qtype == ("Q8_0" if outtype == "Q8_0" else "F16")
    # the Conv3d patch kernel is split along its temporal axis into two 2-D kernels
    w = open_checkpoint(mini_model).get("model.visual.patch_embed.proj.weight")
    assert g.tensors["v.patch_embd.weight"].shape == (64, 3, 14, 14)
    assert np.allclose(g.tensors["v.patch_embd.weight.1"].dequantize(), w[:, :, 1].numpy(), atol=1e-3)
    fc = torch.from_numpy(g.tensors["mm.model.fc.weight"].dequantize())
    ref = open_checkpoint(mini_model).get("model.visual.merger.proj.weight")
    assert torch.allclose(fc, ref, atol=ref.abs().max().item() / 100)


@pytest.mark.slow
def test_mmproj_loads_and_encodes_in_llamacpp(mini_model, tmp_path):
    """llama-cpp-python 0.3.36's multimodal path (mtmd) loads the mmproj next to the text GGUF, warms up, and
    encodes an image into finite embeddings of the text width; F16 and Q8_0 projectors agree."""
    import ctypes

    L = pytest.importorskip("llama_cpp")
    M = pytest.importorskip("llama_cpp.mtmd_cpp")
    from mixq.conversion.gguf.pipeline import convert_gguf

    text = tmp_path / "m.gguf"
    convert_gguf(mini_model, text, qtype="BF16", no_mtp=True, mmproj=tmp_path / "mm-f16.gguf", progress=False)
    write_mmproj(mini_model, tmp_path / "mm-q8.gguf", "Q8_0", progress=False)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(text).encode(), L.llama_model_default_params())
    assert model
    img = (np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)
    embs = []
    try:
        for mm in ("mm-f16.gguf", "mm-q8.gguf"):
            p = M.mtmd_context_params_default()
            p.use_gpu, p.n_threads, p.warmup, p.print_timings = False, 2, True, False
            ctx = M.mtmd_init_from_file(str(tmp_path / mm).encode(), model, p)
            assert ctx and M.mtmd_support_vision(ctx)
            bm = M.mtmd_bitmap_init(56, 56, (ctypes.c_uint8 * img.size).from_buffer_copy(img.tobytes()))
            chunks = M.mtmd_input_chunks_init()
            s = b"look: " + M.mtmd_default_marker() + b" done"
            t = M.mtmd_input_text()
            t.text, t.text_len, t.add_special, t.parse_special = s, len(s), False, True
            assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(t), (M.mtmd_bitmap_p_ctypes * 1)(bm), 1) == 0
            ch = next(M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks))
                      if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i)) != 0)
            n = M.mtmd_input_chunk_get_n_tokens(ch)
            assert M.mtmd_encode_chunk(ctx, ch) == 0
            embs.append(np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(n, 128)).copy())
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bm)
            M.mtmd_free(ctx)
    finally:
        L.llama_model_free(model)
    a, b = embs
    assert a.shape == (16, 128) and np.isfinite(a).all() and a.std() > 0  # 56x56 -> 4x4 merged patches
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
