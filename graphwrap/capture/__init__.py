"""Graphs made, checked and kept: the Capturer (the one owner of capture state), one bucket's
capture and the CUDA work around it, the checks against eager, owned-output slots, the compiled
forward and per-size kernels, the race against eager, the memory budget and the worker."""
