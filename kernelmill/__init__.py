"""kernelmill: generate, tune and serve CUDA kernels."""

__version__ = "0.1.0"
