"""Example attention kernels for kernel-cache's slots, written with
``scaled_dot_product_attention`` over gathered blocks (see docs/custom_kernels.md)."""
