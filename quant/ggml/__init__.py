"""mixq.quant.ggml: ggml's block types, encoded bit-exactly as ggml encodes them.

`registry` declares each type once (block layout from gguf-py's size table, whether it needs an imatrix) with its
encoders: the numpy CPU backend (`numpy_*`, on the converter's worker threads) and the torch backend for every
device (`torch_*`; on CUDA the hot searches are Triton kernels, `triton_*`). `encoders` is the entry point
(`quantize`, `quantize_tensor`, `quantize_stacked`). `hessian_rounding`, `levels` and `block_tuning` are
`--rounding hessian`: GPTQ-style rounding on ggml's grids and the block-output tuning. `libggml` calls
llama.cpp's own libggml-base (the oracle of the tests and benchmarks).
"""
