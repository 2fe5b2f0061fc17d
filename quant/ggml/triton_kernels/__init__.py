"""Every fused Triton kernel of the ggml types: the encoders' scale searches (`search`, `descent`, `grid`) and the
Hessian rounding's and block-output tuning's descents (`refine`, `subscales`, `iq2s`, `iq2s_descent`, `iq2_decode`).
`search` holds the shared launch helpers and the switch (MIXQ_KQUANT_FUSED) that turns them on."""
