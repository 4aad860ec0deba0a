"""Native CUDA kernels: built with nvcc into one cubin per GPU architecture, loaded through the driver API.

``build.build_cuda_kernels(arch) -> bytes`` runs at compile time (standard library only);
``rmsnorm.load_cuda_kernels(cubin, arch)`` and ``rmsnorm.rms_norm`` run on the GPU host (torch,
and the Triton kernel as the fallback). Importing this package loads nothing.
"""
