"""mixq: mixed-precision EXL3 / GGUF quantization of glm5_next MoE checkpoints, with fidelity measurement."""

__version__ = "0.1.0"
