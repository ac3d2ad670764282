"""Suite `precision`: float32 against bfloat16 and int8 inference, lamina and PyTorch in the same run.

- LSTM 256 inference over 64 sequences of 30 steps (input = hidden = 256): lamina float32,
  `net.astype("bfloat16")` and `lm.quantize(net)` (int8); PyTorch float32, under
  `torch.autocast("cpu", dtype=torch.bfloat16)`, and dynamically quantized
  (`torch.ao.quantization.quantize_dynamic`, qint8).
- Linear 256 x 1024 -> 1024 inference: the same three precisions; PyTorch float32, with its weight
  and input in bfloat16, and dynamically quantized.

- The shipped language model's fine-tuning step (batches of 32 chunks of 48 tokens of the
  standard library's sources, Adam): float32 against `net.autocast("bfloat16")`.

GFLOP/s count the products (two per multiply-add). Row `lamina` is lamina in the case's
precision: the ratio column divides each other implementation's time by it (lamina-float32
included)."""
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
    net.set_precision(precision)
    feeds = {"x": lm.Sequences.from_list(_sequences())}
    return lambda: net.run(feeds)


def torch_lstm(precision):
    import torch
    module = _dynamic_int8(torch, torch.nn.LSTM(SIZE, SIZE).eval(), precision)
    data = torch.from_numpy(np.stack(_sequences(), axis=1))  # [steps, batch, size]: equal lengths

    def infer():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            module(data)
    return infer


def _dynamic_int8(torch, module, precision):
    """PyTorch's dynamic quantization of the module's Linear/LSTM weights for 'int8'."""
    if precision != "int8":
        return module
    return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear, torch.nn.LSTM}, dtype=torch.qint8)


def lamina_linear(precision):
    import lamina as lm
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", IN)
    net.outputs(y=lm.layers.Linear(IN, OUT)(x))
    net.set_precision(precision)
    feeds = {"x": np.random.default_rng(2).standard_normal((ROWS, IN)).astype(np.float32)}
    return lambda: net.run(feeds)


def torch_linear(precision):
    import torch
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    module = _dynamic_int8(torch, torch.nn.Linear(IN, OUT).eval().to(dtype), precision)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((ROWS, IN)).astype(np.float32)).to(dtype)

    def infer():
        with torch.inference_mode():
            module(x)
    return infer


def lamina_lm_step(precision):
    import itertools

    import lamina as lm
    from lamina import training
    from lamina.zoo import language
    net = lm.load(lm.models.resolve("python_lm")).autocast(precision)
    files = [str(f) for f in language.stdlib_split()[0][:40]]
    data = training.TextData(net, files)
    opt = lm.optim.Adam(net, lr=1e-4)
    rows = np.arange(32)
    feeds = itertools.cycle([data.batch(rows + 32 * b, training.BatchRandomness(0, 0, b, rows)) for b in range(8)])
    return lambda: net.train_step(next(feeds), opt)


def run(bench, threads, rounds, have_torch):
    rows = []
    cases = (("lstm infer H=256 (64 x 30)", "lstm", 2.0 * 4 * SIZE * 2 * SIZE * STEPS * SEQUENCES),
             (f"linear infer {ROWS}x{IN}->{OUT}", "linear", 2.0 * ROWS * IN * OUT))
    for precision in ("bfloat16", "int8"):
        for name, kind, flops in cases:
            impls = {"lamina": (f"bench.precision:lamina_{kind}", [precision]),
                     "lamina-float32": (f"bench.precision:lamina_{kind}", ["float32"])}
            if have_torch:
                impls.update({f"torch-{p}": (f"bench.precision:torch_{kind}", [p]) for p in (precision, "float32")})
            rows += bench.time_case("precision", f"{name} {precision}", threads, impls, flops, rounds,
                                    turn_seconds=0.2)
    impls = {"lamina": ("bench.precision:lamina_lm_step", ["bfloat16"]),
             "lamina-float32": ("bench.precision:lamina_lm_step", ["float32"])}
    rows += bench.time_case("precision", "language model train step bfloat16", threads, impls, None, rounds,
                            turn_seconds=0.5)
    return rows
