"""Accelerator runtimes behind one interface: sunrise (Tang/PTML), nvidia (NVML/CUDA), host."""
