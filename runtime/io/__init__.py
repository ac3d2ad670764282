"""Model files: one safetensors file, the graph as JSON in its metadata. Data only: no pickle,
no code runs on load. Loading validates the whole description before it builds anything; saving
is atomic (a temporary file in the same folder, fsync, rename)."""
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .model import FORMAT, VERSION, ModelFileError, load, load_description, save, save_description

__all__ = ["save", "load", "save_description", "load_description", "save_checkpoint", "load_checkpoint", "Checkpoint", "ModelFileError",
           "FORMAT", "VERSION"]
