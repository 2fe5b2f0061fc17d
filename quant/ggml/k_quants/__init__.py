"""The K-quants Q2_K…Q6_K (256-weight super-blocks): the numpy backend (`numpy_backend`, the CPU path) and the torch
backend (`torch_backend`, every device), and ggml's scale searches both run (`numpy_search`, `torch_search`; the
legacy types and the i-quants reuse them)."""
