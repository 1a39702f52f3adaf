"""Kernels, one file each. Every file holds the PyTorch reference (the CPU path and the
oracle for tests); Triton versions are added beside their references for the GPU path."""
