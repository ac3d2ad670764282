"""Suite `precision`: float32 against bfloat16 and int8 inference, lamina and PyTorch in the same run.

- LSTM 256 inference over 64 sequences of 30 steps (input = hidden = 256): lamina float32,
  `net.astype("bfloat16")` and `lm.quantize(net)` (int8); PyTorch float32, under
  `torch.autocast("cpu", dtype=torch.bfloat16)`, and dynamically quantized
  (`torch.ao.quantization.quantize_dynamic`, qint8).
- Linear 256 x 1024 -> 1024 inference: the same three precisions; PyTorch float32, with its weight
  and input in bfloat16, and dynamically quantized.
- Convolutions in bfloat16 (inference, batch 16): MobileNet-V2's last pointwise layer (320 ->
  1280 at 7x7) and a strided 3x3 layer (128 -> 256, stride 2, at 28x28); lamina float32 and
  `net.astype("bfloat16")`, PyTorch float32 and under autocast bfloat16.

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


CONVS = {"pointwise 320->1280 7x7": (320, 1280, 1, 1, 7), "3x3 stride 2 128->256 28x28": (128, 256, 3, 2, 28)}
CONV_BATCH = 16


def _conv_input(cin, size):
    return np.random.default_rng(3).standard_normal((CONV_BATCH, cin, size, size)).astype(np.float32)


def lamina_conv(case, precision):
    import lamina as lm
    cin, cout, k, stride, size = CONVS[case]
    lm.manual_seed(0)
    net = lm.Network()
    net.outputs(y=lm.layers.Conv2d(cin, cout, k, stride=stride, padding=k // 2)(net.input("x", (cin, size, size))))
    net.set_precision(precision)
    feeds = {"x": _conv_input(cin, size)}
    return lambda: net.run(feeds)


def torch_conv(case, precision):
    import torch
    cin, cout, k, stride, size = CONVS[case]
    module = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2).eval()
    x = torch.from_numpy(_conv_input(cin, size))

    def infer():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
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
    for case, (cin, cout, k, stride, size) in CONVS.items():
        out = (size + 2 * (k // 2) - k) // stride + 1
        impls = {"lamina": ("bench.precision:lamina_conv", [case, "bfloat16"]),
                 "lamina-float32": ("bench.precision:lamina_conv", [case, "float32"])}
        if have_torch:
            impls.update({f"torch-{p}": ("bench.precision:torch_conv", [case, p]) for p in ("bfloat16", "float32")})
        rows += bench.time_case("precision", f"conv infer {case} b{CONV_BATCH} bfloat16", threads, impls,
                                2.0 * CONV_BATCH * cout * cin * k * k * out * out, rounds, turn_seconds=0.2)
    impls = {"lamina": ("bench.precision:lamina_lm_step", ["bfloat16"]),
             "lamina-float32": ("bench.precision:lamina_lm_step", ["float32"])}
    rows += bench.time_case("precision", "language model train step bfloat16", threads, impls, None, rounds,
                            turn_seconds=0.5)
    return rows
