"""vgpu: fractional NVIDIA GPU slices for Kubernetes."""

__version__ = "0.1.0"
