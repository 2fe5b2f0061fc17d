"""mixq.runtime: running the model for calibration, conversion and evaluation, below convert and eval.

The decoder layers of transformers' glm5_next one at a time (`layer_stream`), calibration text and rows and the
layer-by-layer calibration forward (`calibration`), any written format decoded back to HF-named float weights
(`dequant`), ranks over several devices (`distributed`), child processes that end with their parent
(`child_process`) and host reads overlapped with the device's work (`overlap`). It uses formats and quant only.
"""
