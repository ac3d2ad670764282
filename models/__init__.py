"""The models shipped with lamina, installed with it as the package `lamina.models`:

    import lamina as lm
    net = lm.load(lm.models.path("python_lm"))     # or lamina infer/serve/inspect python_lm

- `python_lm`: a token-level language model of Python source (Embedding, LSTM(256), a
  SelectiveLinear over 4096 tokens trained with sampled softmax);
- `denoise3d`: a volumetric denoiser (Conv3d encoder, ConvTranspose3d decoder, residual);
- `line_kind`: a transformer encoder naming the kind of statement a line of Python starts.

Each model's folder holds its card (README.md); the repository's folders also hold the script
that trained it (train.py).
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("python_lm", "denoise3d", "line_kind")


def path(name: str) -> Path:
    """The model file of a shipped model, by name ('python_lm', 'denoise3d', 'line_kind')."""
    if name not in NAMES:
        raise KeyError(f"no shipped model named {name!r}; lamina ships {', '.join(NAMES)}")
    return HERE / name / "model.lamina"


def names() -> list[str]:
    return list(NAMES)


def resolve(spec: str) -> str:
    """A model argument of the command line: the file it names, else the shipped model of that
    name (so `lamina serve python_lm` works from any folder), else the argument as it is."""
    if Path(spec).exists() or spec not in NAMES:
        return spec
    return str(path(spec))
