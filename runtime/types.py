"""The type names of lamina's public signatures."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    from .selection import Selection
    from .sequence import Sequences

Size = Union[int, Sequence[int]]  # one size for every axis, or one per axis
Shape = Union[int, Sequence[int]]  # a per-sample shape: () for a scalar per row
Feed = Union[np.ndarray, "Sequences", "Selection"]
Feeds = Mapping[str, Feed]  # input name -> its batch
PathLike = Union[str, "os.PathLike[str]"]
