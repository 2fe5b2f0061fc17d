"""mixq.planning: every tensor's bits or ggml type and bytes, before anything is converted.

The plan types (`types`), the EXL3 and GGUF planners (`exl3`, `gguf`, `gguf_measured`) on one budget rule
(`budget`) and the bit allocator (`allocator`), llama-quantize's mix rules (`gguf_mix`), the inference memory model
(`memory`) and `--fit` (`fit`), size and context parsing (`sizes`), and the check that a plan can be written
(`check`). `planner.plan_model` is the entry point. Planning consumes curves; measuring them is
mixq.measurement's.
"""
