"""mixq.conversion: drive conversions from a checkpoint to quantized files.

`exl3/` holds the EXL3 pipeline (calibrated trellis encoding, ranks, families, the DFlash2 drafter) and `gguf/`
the GGUF one (encoder workers, Hessian rounding and tuning, imatrix, receipts, families). `api.convert` is the
`convert` verb; `options` its typed options objects.
"""
