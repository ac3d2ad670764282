"""Checkpoints: a model file plus what resuming training needs, in one file written atomically.

Beside the network (graph, parameters, assets) a checkpoint holds every optimizer state array
('optim/<parameter>/<state>'), the optimizer's step counter (so its learning-rate schedule
continues where it stopped), the states of the network's dropout generator and of lamina's
initialisation generator, and whatever JSON-able fields the caller adds (epoch, position in the
data, the data generator's state). Resuming with the same data order and thread count repeats
the uninterrupted run exactly.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from .. import random as lm_random
from ..graph import Network
from ..parameter import host
from ..types import PathLike
from .model import OPTIM, ModelFileError, _load, _pack, describe, write_atomic


def save_checkpoint(path: PathLike, net: Network, optimizer: Any, **fields: Any) -> None:
    """Write net, optimizer state and `fields` (JSON-able) to `path` atomically."""
    names = {id(p): n for n, p in net.named_parameters()}
    tensors = {}
    for p in optimizer.params:
        for state, value in p.state.items():
            tensors[f"{OPTIM}{names[id(p)]}/{state}"] = np.ascontiguousarray(np.atleast_1d(host(value)))
    info = {"step_count": optimizer.step_count, "optimizer": type(optimizer).__name__,
            "dropout_rng": net.rng.bit_generator.state, "init_rng": lm_random.generator().bit_generator.state,
            "fields": fields}
    write_atomic(path, _pack(net, False, tensors, {"checkpoint": json.dumps(info)}, exact=True))


def graph_difference(a, b):
    """None when networks a and b have the same graph (inputs, layers and their configurations,
    connections, outputs, parameter names and shapes), else a phrase saying the first difference."""
    ga, ta = describe(a, exact=True)
    gb, tb = describe(b, exact=True)
    differs = description_difference(ga, gb)
    if differs:
        return differs
    for key, value in ta.items():
        if value.shape != tb[key].shape:
            return f"parameter '{key}' has shape {value.shape} against {tb[key].shape}"
    return None


def description_difference(ga, gb):
    """None when two graph descriptions (io.model.describe_graph) are the same, else a phrase
    saying the first difference."""
    for part in ("inputs", "nodes", "outputs"):
        if ga[part] != gb[part]:
            first = next(((a, b) for a, b in zip(ga[part], gb[part]) if a != b), None)
            if isinstance(ga[part], list) and first is not None:
                return f"its {part} differ: {first[0]} against {first[1]}"
            return f"its {part} differ ({ga[part]} against {gb[part]})"
    la = {l["name"]: l for l in ga["layers"]}
    lb = {l["name"]: l for l in gb["layers"]}
    if list(la) != list(lb):
        return f"its layers differ ({', '.join(la)} against {', '.join(lb)})"
    for name, layer in la.items():
        other = lb[name]
        for key in ("kind", "config", "params"):
            if layer[key] != other[key]:
                return f"layer '{name}' differs in its {key} ({layer[key]} against {other[key]})"
    return None


class Checkpoint:
    """A loaded checkpoint: `net`, the caller's `fields`, `restore(optimizer)` and
    `load_into(net)`."""

    def __init__(self, path, net, info, tensors):
        self.path, self.net, self._info, self._tensors = path, net, info, tensors
        self.fields = info.get("fields", {})
        self.step_count = int(info.get("step_count", 0))

    def restore(self, optimizer: Any) -> None:
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


    def load_into(self, net: Network) -> Network:
        """Copy the checkpoint's parameter values into `net`, which must have the checkpoint's
        graph; a checkpoint of another network is a ModelFileError that says what differs.
        Returns net."""
        differs = graph_difference(self.net, net)
        if differs:
            raise ModelFileError(f"{self.path}: the checkpoint is of another network: {differs}")
        theirs = dict(net.named_parameters())
        with net._lock.write():
            for name, p in self.net.named_parameters():
                theirs[name].assign(p.value)
        return net


def load_checkpoint(path: PathLike) -> Checkpoint:
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
