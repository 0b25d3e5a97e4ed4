"""Memory before the run: ``ft.memory`` predicts a step's bytes per rank on fake tensors, and
``ft.fit`` picks the composition that fits a budget (see docs/memory.md)."""

from ftrain.memory.fit import fit
from ftrain.memory.predict import memory
from ftrain.memory.report import Candidate, FitReport, MemoryReport, format_bytes, parse_bytes

__all__ = ["memory", "fit", "MemoryReport", "FitReport", "Candidate", "parse_bytes", "format_bytes"]
