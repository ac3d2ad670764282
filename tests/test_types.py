"""The package's type hints: mypy finds no error in it, and every function and method of the
public API (lamina, lamina.layers, lamina.optim, lamina.onnx, lamina.serve, lamina.distributed,
lamina.models) annotates each parameter and its return."""
import inspect
import subprocess
import sys
from pathlib import Path

import lamina as lm

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error():
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert (Path(lm.__file__).parent / "py.typed").exists()


def public_callables():
    import lamina.distributed as dist
    import lamina.layers as layers
    onnx = lm.onnx
    import lamina.optim as optim
    import lamina.serve as serve
    found = {}
    for module, names in ((lm, ["load", "save", "load_checkpoint", "save_checkpoint", "sampled_selection", "top_k"]),
                          (onnx, ["load", "save", "feeds"]), (serve, ["serve", "load_models"]),
                          (dist, ["init", "shard", "data_parallel", "rank", "size"]),
                          (lm.models, ["path", "names", "resolve"])):
        for name in names:
            found[f"{module.__name__}.{name}"] = getattr(module, name)
    classes = [lm.Network, lm.Sequences, serve.Client, dist.ShardedSampler, dist.World]
    classes += [c for c in vars(layers).values() if inspect.isclass(c) and issubclass(c, layers.Layer)
                and c is not layers.Layer]
    classes += [c for c in vars(optim).values() if inspect.isclass(c) and issubclass(c, optim.Optimizer)]
    for cls in classes:
        for name, member in vars(cls).items():
            if inspect.isfunction(member) and (not name.startswith("_") or name in ("__init__", "__call__")):
                if cls in (lm.Network, lm.Sequences, serve.Client) or name == "__init__":
                    found[f"{cls.__module__}.{cls.__name__}.{name}"] = member
    return found


def test_the_public_api_is_annotated():
    missing = []
    for where, fn in public_callables().items():
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                missing.append(f"{where}({p.name})")
        if sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{where} -> ?")
    assert not missing, "unannotated: " + ", ".join(missing)
