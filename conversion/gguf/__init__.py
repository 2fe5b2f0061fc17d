"""GGUF conversion: the pipeline, encoder workers, Hessian rounding and tuning, imatrix, receipts and families."""
