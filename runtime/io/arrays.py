"""Network inputs from an .npz file (the `lamina` command's data and input files): one array per
input, named after it; a sequence input as NAME (the rows) and NAME.starts (int32 offsets); a
selection input as NAME.columns, plus NAME.starts for a per-row selection. Values come back in
the input's type (the network's float type, or int32)."""
import numpy as np

from ..errors import InputError
from ..selection import Selection
from ..sequence import Sequences


def load_feeds(net, path):
    """{input name: array, Sequences or Selection} for every input of `net` the file holds."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read the file ({e})") from None
    feeds = {}
    for name in net.input_names:
        spec = net.values[name].spec
        if spec.kind == "selection":
            if f"{name}.columns" in arrays:
                starts = arrays.get(f"{name}.starts")
                feeds[name] = Selection(arrays[f"{name}.columns"].astype(np.int32),
                                        None if starts is None else starts.astype(np.int32))
        elif name in arrays:
            values = np.ascontiguousarray(arrays[name], dtype=net.dtype if spec.kind == "float" else np.int32)
            if spec.sequence:
                if f"{name}.starts" not in arrays:
                    raise InputError(f"{path}: sequence input '{name}' needs '{name}.starts' beside it")
                feeds[name] = Sequences(values, arrays[f"{name}.starts"].astype(np.int32))
            else:
                feeds[name] = values
    if not feeds:
        raise InputError(f"{path}: no array is named after an input of the model "
                         f"({', '.join(net.input_names)}); found {', '.join(arrays) or 'nothing'}")
    return feeds
