"""mixq.quant.ggml: ggml's block types, encoded bit-exactly as ggml encodes them.

`registry` declares each type once (its layout and imatrix needs are formats/gguf_layout's) with its encoders, filed
by type family: `k_quants` (Q2_K…Q6_K and the scale searches), `i_quants` (IQ2/IQ3 lattice types, IQ4), `legacy`
(Q8_0, Q4_0…Q5_1), each with a numpy CPU backend and a torch backend for every device; on CUDA the hot searches are
Triton kernels (`triton_kernels`). `encoders` is the entry point (`quantize`, `quantize_tensor`, `quantize_stacked`);
`torch_encoders` runs the torch backends in chunks on a device; `torch_decode` dequantizes every type. `rounding` is
`--rounding hessian`: GPTQ-style rounding on ggml's grids and the block-output tuning. `libggml` calls llama.cpp's own
libggml-base (the oracle of the tests and benchmarks).
"""
