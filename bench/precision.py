"""Suite `precision`: float32 against bfloat16 inference, lamina and PyTorch in the same run.

- LSTM 256 inference over 64 sequences of 30 steps (input = hidden = 256): lamina float32 and
  `net.astype("bfloat16")`; PyTorch float32 and under `torch.autocast("cpu", dtype=torch.bfloat16)`.
- Linear 256 x 1024 -> 1024 inference: lamina float32 and bfloat16; PyTorch float32 and with its
  weight and input in bfloat16.

GFLOP/s count the products (two per multiply-add). Row `lamina` is lamina in bfloat16: the ratio
column divides each other implementation's time by it (lamina-float32 included)."""
import numpy as np

STEPS, SEQUENCES, SIZE = 30, 64, 256
ROWS, IN, OUT = 256, 1024, 1024


def _sequences():
    rng = np.random.default_rng(1)
    return [rng.standard_normal((STEPS, SIZE)).astype(np.float32) for _ in range(SEQUENCES)]


def lamina_lstm(precision):
    import lamina as lm
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", SIZE, sequence=True)
    net.outputs(out=lm.layers.LSTM(SIZE, SIZE)(x)[0])
    net.astype(precision)
    feeds = {"x": lm.Sequences.from_list(_sequences())}
    return lambda: net.run(feeds)


def torch_lstm(precision):
    import torch
    module = torch.nn.LSTM(SIZE, SIZE).eval()
    data = torch.from_numpy(np.stack(_sequences(), axis=1))  # [steps, batch, size]: equal lengths

    def infer():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            module(data)
    return infer


def lamina_linear(precision):
    import lamina as lm
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", IN)
    net.outputs(y=lm.layers.Linear(IN, OUT)(x))
    net.astype(precision)
    feeds = {"x": np.random.default_rng(2).standard_normal((ROWS, IN)).astype(np.float32)}
    return lambda: net.run(feeds)


def torch_linear(precision):
    import torch
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    module = torch.nn.Linear(IN, OUT).eval().to(dtype)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((ROWS, IN)).astype(np.float32)).to(dtype)

    def infer():
        with torch.inference_mode():
            module(x)
    return infer


def run(bench, threads, rounds, have_torch):
    rows = []
    cases = (("lstm infer H=256 (64 x 30)", "lstm", 2.0 * 4 * SIZE * 2 * SIZE * STEPS * SEQUENCES),
             (f"linear infer {ROWS}x{IN}->{OUT}", "linear", 2.0 * ROWS * IN * OUT))
    for name, kind, flops in cases:
        impls = {"lamina": (f"bench.precision:lamina_{kind}", ["bfloat16"]),
                 "lamina-float32": (f"bench.precision:lamina_{kind}", ["float32"])}
        if have_torch:
            impls.update({f"torch-{p}": (f"bench.precision:torch_{kind}", [p]) for p in ("bfloat16", "float32")})
        rows += bench.time_case("precision", name, threads, impls, flops, rounds, turn_seconds=0.2)
    return rows
