"""Model files: one safetensors file, the graph as JSON in its metadata. Data only: no pickle,
no code runs on load. Loading validates the whole description before it builds anything; saving
is atomic (a temporary file in the same folder, fsync, rename)."""
from .model import FORMAT, VERSION, load, save

__all__ = ["save", "load", "FORMAT", "VERSION"]
