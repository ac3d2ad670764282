"""Suite `selective`: the selective fully-connected layer over a large vocabulary (batch 128,
input 512, 50 000 classes), forward and forward+backward (input, weight and bias gradients):
- per-row selections of 500 random columns, against the best PyTorch formulations: a sparse
  nn.Embedding lookup of the weight rows + batched matmul, and a hand-written autograd function
  (gather + batched matmul forward, sparse COO weight gradient backward);
- a shared selection of 500 columns, against index_select + F.linear;
- the full layer, against nn.Linear;
- the crossover: per-row selections of growing density on lamina's sparse path (the subject)
  against its dense path (the peer), which sets lamina.layers.selective.DENSE_RATIO.
GFLOP/s count the useful multiply-adds only (2 x entries x input per product, three products
for forward+backward)."""
import numpy as np

from .harness import lamina_step

BATCH, N_IN, N_OUT, K = 128, 512, 50_000, 500
MODES = {"fwd": 1, "fwd+bwd": 3}
CROSSOVER = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16]


def _columns(kind, k=K):
    rng = np.random.default_rng(0)
    if kind == "per-row":
        return np.stack([rng.choice(N_OUT, k, replace=False) for _ in range(BATCH)]).astype(np.int32)
    if kind == "shared":
        return rng.choice(N_OUT, k, replace=False).astype(np.int32)
    return None


def _data(entries):
    rng = np.random.default_rng(1)
    return (rng.standard_normal((BATCH, N_IN)).astype(np.float32),
            rng.standard_normal(entries).astype(np.float32))


def lamina_selective(mode, kind, k=K, path="auto", device="cpu"):
    import lamina as lm
    net = lm.Network()
    x = net.input("x", N_IN)
    x.requires_grad = True
    cols = _columns(kind, k)
    if cols is None:
        net.outputs(y=lm.layers.SelectiveLinear(N_IN, N_OUT)(x))
        X, G = _data(BATCH * N_OUT)
        return lamina_step(net, {"x": X}, {"y": G.reshape(BATCH, N_OUT)}, mode, device)
    sel = net.input("sel", dtype="selection")
    net.outputs(y=lm.layers.SelectiveLinear(N_IN, N_OUT, path=path)(x, sel))
    if kind == "per-row":
        selection = lm.Selection.per_row(np.arange(BATCH + 1, dtype=np.int32) * k, cols.reshape(-1))
    else:
        selection = lm.Selection.shared(cols)
    X, G = _data(selection.num_entries(BATCH))
    return lamina_step(net, {"x": X, "sel": selection}, {"y": G}, mode, device)


def torch_selective(mode, kind, formulation):
    import torch
    torch.manual_seed(0)
    cols_np = _columns(kind)
    per_row = BATCH * (N_OUT if cols_np is None else cols_np.shape[-1])
    X, G = (torch.from_numpy(a) for a in _data(per_row))
    X.requires_grad_(True)
    lin = torch.nn.Linear(N_IN, N_OUT)
    if formulation == "full":
        G = G.reshape(BATCH, N_OUT)
        fn = lambda: lin(X)
        params = list(lin.parameters())
    elif formulation == "index_select":  # shared selection
        cols = torch.from_numpy(cols_np).long()
        G = G.reshape(BATCH, -1)
        fn = lambda: torch.nn.functional.linear(X, lin.weight.index_select(0, cols), lin.bias.index_select(0, cols))
        params = list(lin.parameters())
    elif formulation == "embedding_bmm":  # per row: sparse embedding lookups + batched matmul
        cols = torch.from_numpy(cols_np).long()
        G = G.reshape(BATCH, -1)
        weight = torch.nn.Embedding(N_OUT, N_IN, sparse=True)
        bias = torch.nn.Embedding(N_OUT, 1, sparse=True)
        fn = lambda: torch.bmm(weight(cols), X.unsqueeze(2)).squeeze(2) + bias(cols).squeeze(2)
        params = list(weight.parameters()) + list(bias.parameters())
    else:  # "sparse_fn": per row, a hand-written autograd function with sparse weight gradients
        cols = torch.from_numpy(cols_np).long()
        G = G.reshape(BATCH, -1)
        sparse_fn = _sparse_fn_class()
        fn = lambda: sparse_fn.apply(X, lin.weight, lin.bias, cols)
        params = list(lin.parameters())

    def forward():
        with torch.no_grad():
            fn()

    def forward_backward():
        for p in params:
            p.grad = None
        X.grad = None
        fn().backward(G)
    return forward if mode == "fwd" else forward_backward


def _sparse_fn_class():
    import torch

    class SparseSelected(torch.autograd.Function):
        """out[i, j] = x[i] · W[cols[i, j]] + b[cols[i, j]]; W and b get sparse COO gradients."""

        @staticmethod
        def forward(ctx, x, weight, bias, cols):
            w_sel = weight[cols]  # [B, K, in]
            ctx.save_for_backward(x, w_sel, cols)
            ctx.shapes = weight.shape, bias.shape
            return torch.bmm(w_sel, x.unsqueeze(2)).squeeze(2) + bias[cols]

        @staticmethod
        def backward(ctx, g):
            x, w_sel, cols = ctx.saved_tensors
            w_shape, b_shape = ctx.shapes
            dx = torch.bmm(g.unsqueeze(1), w_sel).squeeze(1)
            index = cols.reshape(1, -1)
            dw = torch.sparse_coo_tensor(index, (g.unsqueeze(2) * x.unsqueeze(1)).reshape(-1, x.shape[1]), w_shape)
            db = torch.sparse_coo_tensor(index, g.reshape(-1), b_shape)
            return dx, dw, db, None
    return SparseSelected


def run(bench, threads, rounds, have_torch):
    rows = []
    peers = {"per-row": ["embedding_bmm", "sparse_fn"], "shared": ["index_select"], "full": ["full"]}
    for kind, formulations in peers.items():
        entries = BATCH * (N_OUT if kind == "full" else K)
        for mode, products in MODES.items():
            impls = {"lamina": ("bench.selective:lamina_selective", [mode, kind])}
            if have_torch:
                for f in formulations:
                    impls[f"torch-{f.replace('_', '-')}"] = ("bench.selective:torch_selective", [mode, kind, f])
            rows += bench.time_case("select", f"{mode} {kind} {K if kind != 'full' else N_OUT}", threads,
                                    impls, products * 2.0 * entries * N_IN, rounds)
    for density in CROSSOVER:
        k = int(round(density * N_OUT))
        impls = {"lamina": ("bench.selective:lamina_selective", ["fwd+bwd", "per-row", k, "sparse"]),
                 "lamina-dense": ("bench.selective:lamina_selective", ["fwd+bwd", "per-row", k, "dense"])}
        rows += bench.time_case("select", f"crossover {density:g} (k={k})", threads, impls,
                                3 * 2.0 * BATCH * k * N_IN, max(2, rounds // 2))
    return rows
