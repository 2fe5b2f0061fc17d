"""mixq.measurement: how much each budgeted unit's quantization costs, as error curves the planner reads.

`trellis` measures EXL3 trellis error curves (and reads / writes curves files), `gguf_errors` GGUF per-type errors
with the Hessians of `hessians` and the encodes of `encode_cache`; `kld` and `gguf_kld` scale them to end-to-end
KLD with the reference forward; `plan_run` resolves `--measure` and plans with the curves.
"""
