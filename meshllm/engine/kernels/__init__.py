"""Hand-written CPU kernels (C, loaded with ctypes), built by `python -m meshllm.engine.kernels.build`."""
