"""Network inputs from an .npz file (the `lamina` command's data and input files): one array per
input, named after it; a sequence input as NAME (the rows) and NAME.starts (int32 offsets); a
selection input as NAME.columns, plus NAME.starts for a per-row selection. Values come back in
the input's type (the network's float type, or int32)."""
import numpy as np

from ..errors import InputError
from ..selection import Selection
from ..sequence import SequenceError, Sequences

_INT32 = np.iinfo(np.int32)


def _int32(arrays, key, path):
    """arrays[key] as int32: integers that fit, never a silent narrowing (2**32 + 5 is not 5)."""
    a = arrays[key]
    if a.dtype.kind not in "iu":
        raise InputError(f"{path}: '{key}' must hold integers, found {a.dtype}")
    if a.size and (a.min() < _INT32.min or a.max() > _INT32.max):
        flat = a.reshape(-1)
        at = int(np.flatnonzero((flat < _INT32.min) | (flat > _INT32.max))[0])
        raise InputError(f"{path}: '{key}' must fit int32, found {flat[at]} at position {at}")
    return np.ascontiguousarray(a, dtype=np.int32)


def load_feeds(net, path):
    """{input name: array, Sequences or Selection} for every input of `net` the file holds."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise InputError(f"{path}: cannot read the file as .npz ({e})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputError(f"{path}: expected an .npz archive of arrays named after the inputs, found a single "
                         f"array (.npy); save it with np.savez(path, name=array)")
    try:
        with loaded as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError) as e:
        raise InputError(f"{path}: cannot read the file as .npz ({e})") from None
    feeds = {}
    for name in net.input_names:
        spec = net.values[name].spec
        if spec.kind == "selection":
            if f"{name}.columns" in arrays:
                starts = arrays.get(f"{name}.starts")
                feeds[name] = Selection(_int32(arrays, f"{name}.columns", path),
                                        None if starts is None else _int32(arrays, f"{name}.starts", path))
        elif name in arrays:
            values = (np.ascontiguousarray(arrays[name], dtype=net.dtype) if spec.kind == "float"
                      else _int32(arrays, name, path))
            if spec.sequence:
                if f"{name}.starts" not in arrays:
                    raise InputError(f"{path}: sequence input '{name}' needs '{name}.starts' beside it")
                try:
                    feeds[name] = Sequences(values, _int32(arrays, f"{name}.starts", path))
                except SequenceError as e:
                    raise InputError(f"{path}: '{name}': {e}") from None
            else:
                feeds[name] = values
    if not feeds:
        raise InputError(f"{path}: no array is named after an input of the model "
                         f"({', '.join(net.input_names)}); found {', '.join(arrays) or 'nothing'}")
    return feeds
