"""MGX kernels: one entry point per IR op and per backend.

``reference/`` is the numpy oracle (fp32 compute, small and obviously correct); faster backends
(``cpu/`` C++, ``triton/``, ``cuda/``) are tested against it. Importing this package loads nothing.
"""
