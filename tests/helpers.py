import numpy as np


def rand(rng, *shape, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def json_places(value, prefix=()):
    """Every place in a parsed JSON value, as a tuple of keys and indices (the whole value: ())."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_places(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_places(v, prefix + (i,))


def replace_at(value, place, new):
    """Set the JSON value at `place` (json_places) of `value`, in place."""
    target = value
    for key in place[:-1]:
        target = target[key]
    target[place[-1]] = new


def json_values(max_leaves=12, int_bits=40, nan=False):
    """A hypothesis strategy of JSON values: null, booleans, integers of up to `int_bits` bits,
    floats (NaN and infinities with nan=True), short strings, and lists and objects of them."""
    from hypothesis import strategies as st
    scalars = (st.none() | st.booleans() | st.integers(-2 ** int_bits, 2 ** int_bits)
               | st.floats(allow_nan=nan, allow_infinity=nan) | st.text(max_size=8))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=max_leaves)


def one_step_sequences(rows, width, seed):
    """`rows` sequences of one step of `width` features each (a lamina.Sequences)."""
    import lamina as lm
    rng = np.random.default_rng(seed)
    return lm.Sequences.from_list([rng.standard_normal((1, width)).astype(np.float32) for _ in range(rows)])


def one_layer_network(make, width, low_precision=None):
    """A network of one layer (make() builds it) over sequences of `width` features, its first
    output named 'y'; the same parameters each time (seeded). low_precision: on a CPU backend
    whose bfloat16 and int8 products take that path ('float32', 'mkl')."""
    import lamina as lm
    lm.manual_seed(4)
    net = lm.Network()
    x = net.input("x", width, sequence=True)
    out = make()(x)
    net.outputs(y=out[0] if isinstance(out, tuple) else out)
    return net.to(lm.CPUBackend(low_precision=low_precision)) if low_precision else net
