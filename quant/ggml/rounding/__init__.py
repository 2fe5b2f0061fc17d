"""`--rounding hessian` for the ggml types: the level codes inside encoded blocks (`levels`), GPTQ-style rounding on
ggml's grids (`hessian`) and the block-output tuning (`block_tuning`)."""
