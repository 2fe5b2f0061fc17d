"""ggml's 32-weight legacy types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the numpy importance path (`numpy_backend`) and the
torch backend (`torch_backend`)."""
