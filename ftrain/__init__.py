"""ftrain: functional training for PyTorch."""

__version__ = "0.1.0"
