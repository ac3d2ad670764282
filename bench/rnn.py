"""Suite `rnn`: RNN, LSTM and GRU over 64 sequences with lengths drawn uniformly from 10..50
(seed 0), input = hidden = 256 and 512; inference and a training step (forward, backward and
weight gradients). Peers: PyTorch with a PackedSequence and with a padded batch, and ONNX Runtime
(LSTM exported from PyTorch, padded), and the raw sgemm calls of the same GEMMs (MKL and OpenBLAS)
as the floor lamina's own time is compared with. GFLOP/s count the useful work only: the two GEMMs
per step over true lengths, and for a training step 2.5x that: backward adds the recurrent
product and the two weight gradients, and no implementation computes an input gradient (the input
does not ask for one).

Two cases measure the ends of serving (lamina serve batches concurrent requests): "alone" runs
the same 64 LSTM sequences one at a time (a lone request each; PyTorch likewise, one
unpacked sequence per call, ONNX Runtime a batch of one), "B=512" runs 512 sequences of lengths
10..50 packed in one call (ONNX Runtime: padded)."""
import os

import numpy as np

from .harness import RAW_GEMM, lamina_step

BATCH, MIN_LEN, MAX_LEN = 64, 10, 50
KINDS = {"rnn": 1, "lstm": 4, "gru": 3}  # gates


def lengths(batch=BATCH):
    return np.random.default_rng(0).integers(MIN_LEN, MAX_LEN + 1, batch)


def _sequences(size, batch=BATCH):
    rng = np.random.default_rng(1)
    return [rng.standard_normal((n, size)).astype(np.float32) for n in lengths(batch)]


def useful_flops(kind, size, mode, batch=BATCH):
    steps = int(lengths(batch).sum())
    forward = 2.0 * KINDS[kind] * size * (size + size) * steps
    return forward * (2.5 if mode == "train" else 1)


def lamina_rnn(kind, mode, size, device="cpu", batch=BATCH, alone=False):
    import lamina as lm
    net = lm.Network()
    x = net.input("x", size, sequence=True)
    packed = {"auto": None, "packed": True, "plain": False}[os.environ.get("LAMINA_BENCH_PACKED", "auto")]
    layer = {"rnn": lm.layers.RNN, "lstm": lm.layers.LSTM, "gru": lm.layers.GRU}[kind](size, size, packed=packed)
    net.outputs(out=layer(x)[0])
    if alone:  # each sequence a request of its own
        feeds = [{"x": lm.Sequences.from_list([s])} for s in _sequences(size, batch)]
        return lambda: [net.run(f) for f in feeds]
    seqs = lm.Sequences.from_list(_sequences(size, batch))
    grad = {"out": np.random.default_rng(2).standard_normal((seqs.total_steps, size)).astype(np.float32)}
    return lamina_step(net, {"x": seqs}, grad, mode, device)


def torch_rnn(kind, mode, size, layout, batch=BATCH, alone=False):
    import torch
    module = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](size, size, batch_first=True)
    seqs = [torch.from_numpy(s) for s in _sequences(size, batch)]
    if alone:
        def each():
            with torch.no_grad():
                for s in seqs:
                    module(s[None])
        return each
    if layout == "packed":
        data = torch.nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
        grad = torch.randn(data.data.shape)
    else:
        data = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        grad = torch.randn(data.shape[0], data.shape[1], size)

    def infer():
        with torch.no_grad():
            module(data)

    def train():
        module.zero_grad(set_to_none=False)
        out = module(data)[0]
        (out.data if layout == "packed" else out).backward(grad)
    return infer if mode == "infer" else train


def ort_lstm(size, batch=BATCH, alone=False):
    """LSTM exported from PyTorch and run by ONNX Runtime: the batch padded to its longest
    sequence, or each sequence alone (a batch of one, no padding)."""
    import io

    import onnxruntime as ort
    import torch
    module = torch.nn.LSTM(size, size)
    seqs = [torch.from_numpy(s) for s in _sequences(size, batch)]
    padded = torch.nn.utils.rnn.pad_sequence(seqs)
    buf = io.BytesIO()
    torch.onnx.export(module, (padded,), buf, input_names=["x"], output_names=["y", "h", "c"], dynamo=False,
                      dynamic_axes={"x": {0: "time", 1: "batch"}, "y": {0: "time", 2: "batch"}})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    if alone:
        feeds = [{"x": s.numpy()[:, None]} for s in seqs]
        return lambda: [session.run(["y"], f) for f in feeds]
    feed = {"x": padded.numpy()}
    return lambda: session.run(["y"], feed)


def ort_factory(size, threads, batch=BATCH, alone=False):
    import torch
    torch.set_num_threads(threads)  # read by ort_lstm for the session's thread count
    return ort_lstm(size, batch, alone)


def run(bench, threads, rounds, have_torch, have_ort=False):
    rows = []
    for size in (256, 512):
        for kind in KINDS:
            for mode in ("infer", "train"):
                impls = {"lamina": ("bench.rnn:lamina_rnn", [kind, mode, size])}
                if have_torch:
                    impls["torch-packed"] = ("bench.rnn:torch_rnn", [kind, mode, size, "packed"])
                    impls["torch-padded"] = ("bench.rnn:torch_rnn", [kind, mode, size, "padded"])
                if have_ort and have_torch and kind == "lstm" and mode == "infer":
                    impls["onnxruntime"] = ("bench.rnn:ort_factory", [size, threads])
                for impl, name in RAW_GEMM.items():
                    impls[impl] = ("bench.rnn:raw_rnn", [name, kind, mode, size])
                rows += bench.time_case("rnn", f"{kind} {mode} H={size}", threads, impls,
                                        useful_flops(kind, size, mode), rounds, turn_seconds=0.2,
                                        with_peak=True)
    # the two ends of serving: each request alone, and a full batch
    for name, batch, alone in (("lstm alone H=256 (64 x 1)", BATCH, True), ("lstm infer H=256 B=512", 512, False)):
        impls = {"lamina": ("bench.rnn:lamina_rnn", ["lstm", "infer", 256, "cpu", batch, alone])}
        if have_torch:
            impls["torch-packed" if not alone else "torch-alone"] = (
                "bench.rnn:torch_rnn", ["lstm", "infer", 256, "packed", batch, alone])
            if have_ort:
                impls["onnxruntime"] = ("bench.rnn:ort_factory", [256, threads, batch, alone])
        rows += bench.time_case("rnn", name, threads, impls, useful_flops("lstm", 256, "infer", batch), rounds,
                                turn_seconds=0.2, with_peak=True)
    return rows


def raw_rnn(provider_name, kind, mode, size):
    """The same GEMMs as lamina's layer, alone (no gathers, cells or bias): the input projection
    for all steps, one recurrent product per step over the running sequences and, for a training
    step, the recurrent products of backward and the two weight-gradient GEMMs."""
    from lamina.sequence import BatchOrder

    from .harness import raw_provider
    p = raw_provider(provider_name)
    lens = lengths()
    starts = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(lens, out=starts[1:])
    order = BatchOrder(starts)
    total, gh = int(starts[-1]), KINDS[kind] * size
    rng = np.random.default_rng(3)
    x, h, dh = (rng.standard_normal((total, size)).astype(np.float32) for _ in range(3))
    g, dg = (rng.standard_normal((total, gh)).astype(np.float32) for _ in range(2))
    w_ih, w_hh, dw_ih, dw_hh = (rng.standard_normal((gh, size)).astype(np.float32) for _ in range(4))
    steps = [(order.step(t), int(order.step_starts[t - 1])) for t in range(1, order.steps)]

    def forward():
        p.gemm(x, w_ih, g, False, True, 1.0, 0.0)
        for (r0, b), p0 in steps:
            p.gemm(h[p0:p0 + b], w_hh, g[r0:r0 + b], False, True, 1.0, 1.0)

    def train():
        forward()
        for (r0, b), p0 in reversed(steps):
            p.gemm(dg[r0:r0 + b], w_hh, dh[p0:p0 + b], False, False, 1.0, 1.0)
        p.gemm(dg, x, dw_ih, True, False, 1.0, 0.0)
        p.gemm(dg, h, dw_hh, True, False, 1.0, 0.0)
    return forward if mode == "infer" else train
