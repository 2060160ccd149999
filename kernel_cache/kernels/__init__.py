"""The attention kernels a variant is exported from: the plain PyTorch modules,
the real-KV CPU kernels, the Triton kernels for CUDA and the eager reference."""
