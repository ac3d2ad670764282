"""The generator behind parameter initialisation; `lamina.manual_seed` makes it repeatable."""
import numpy as np

_rng = np.random.default_rng()


def manual_seed(seed):
    global _rng
    _rng = np.random.default_rng(seed)


def generator():
    return _rng
