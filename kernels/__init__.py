"""Triton kernels and their torch references (installed as ``tangram_sgl.kernels``)."""
