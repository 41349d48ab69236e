"""The project's GPU code, executed on the CPU: the CUDA kernels compiled for the host
(cuda_on_cpu.h, kernels.py) and a CuPy stand-in (fake_cupy.py). See README.md here."""
