"""Checkpoints: a model file plus what resuming training needs, in one file written atomically.

Beside the network (graph, parameters, assets) a checkpoint holds every optimizer state array
('optim/<parameter>/<state>'), the optimizer's step counter (so its learning-rate schedule
continues where it stopped), the states of the network's dropout generator and of lamina's
initialisation generator, and whatever JSON-able fields the caller adds (epoch, position in the
data, the data generator's state). Resuming with the same data order and thread count repeats
the uninterrupted run exactly.
"""
import json

import numpy as np

from .. import random as lm_random
from ..parameter import host
from .model import OPTIM, ModelFileError, _load, _pack, write_atomic


def save_checkpoint(path, net, optimizer, **fields):
    """Write net, optimizer state and `fields` (JSON-able) to `path` atomically."""
    names = {id(p): n for n, p in net.named_parameters()}
    tensors = {}
    for p in optimizer.params:
        for state, value in p.state.items():
            tensors[f"{OPTIM}{names[id(p)]}/{state}"] = np.ascontiguousarray(np.atleast_1d(host(value)))
    info = {"step_count": optimizer.step_count, "optimizer": type(optimizer).__name__,
            "dropout_rng": net.rng.bit_generator.state, "init_rng": lm_random.generator().bit_generator.state,
            "fields": fields}
    write_atomic(path, _pack(net, False, tensors, {"checkpoint": json.dumps(info)}))


class Checkpoint:
    """A loaded checkpoint: `net`, the caller's `fields`, and `restore(optimizer)`."""

    def __init__(self, path, net, info, tensors):
        self.path, self.net, self._info, self._tensors = path, net, info, tensors
        self.fields = info.get("fields", {})
        self.step_count = int(info.get("step_count", 0))

    def restore(self, optimizer):
        """Put the saved optimizer state and step counter into `optimizer` (built over this
        checkpoint's network, of the same type as the one saved)."""
        saved = self._info.get("optimizer")
        if saved != type(optimizer).__name__:
            raise ModelFileError(f"{self.path}: the checkpoint holds {saved} state, the optimizer is "
                                 f"{type(optimizer).__name__}")
        names = {id(p): n for n, p in self.net.named_parameters()}
        for p in optimizer.params:
            prefix = f"{OPTIM}{names[id(p)]}/"
            p.state = {}
            for key, value in self._tensors.items():
                if key.startswith(prefix):
                    state = key[len(prefix):]
                    p.state[state] = value.reshape(()) if state == "step" else value.reshape(p.shape).copy()
        optimizer.step_count = self.step_count
        optimizer.current_lr = optimizer.lr * optimizer.schedule(self.step_count)
        return optimizer


def load_checkpoint(path):
    """Read a checkpoint written by save_checkpoint; the generators' states are restored."""
    net, metadata, tensors = _load(path)
    if "checkpoint" not in metadata:
        raise ModelFileError(f"{path}: a model file, not a checkpoint (no optimizer state)")
    try:
        info = json.loads(metadata["checkpoint"])
        net.rng.bit_generator.state = info["dropout_rng"]
        lm_random.generator().bit_generator.state = info["init_rng"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{path}: the checkpoint's description is damaged ({e})") from None
    return Checkpoint(path, net, info, tensors)
