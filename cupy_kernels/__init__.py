"""CUDA paged-attention kernels compiled with CuPy, each with a torch reference (later issue)."""
