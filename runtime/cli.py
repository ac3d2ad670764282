"""The `lamina` command: infer, train, inspect, devices, bench.

    lamina infer MODEL INPUT [--output OUT.npz]     run a model on an .npz (or, for a text model,
                                                    a source file or --text) and print or save
    lamina train MODEL DATA [--epochs ...]          fine-tune on an .npz (or source files)
    lamina inspect MODEL                            layers, shapes, parameters, format version
    lamina devices                                  the CPU and every OpenCL device
    lamina bench [SUITE ...]                        the benchmarks of bench/

Every command takes --device cpu|opencl[:N] and --threads N.
"""
import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """A user mistake the command reports in one line (exit status 2)."""


# ---------------------------------------------------------------------------- helpers

def _setup(args):
    import lamina as lm
    if args.threads is not None:
        if args.threads < 1:
            raise CommandError(f"--threads must be at least 1, found {args.threads}")
        lm.set_num_threads(args.threads)
    device = args.device or "cpu"
    if device != "cpu" and device.split(":")[0] != "opencl":
        raise CommandError(f"--device must be cpu or opencl[:N], found {device!r}")
    return lm


def _place(net, args):
    """Put a loaded network on the --device (OpenCL errors become one clear line)."""
    if (args.device or "cpu") == "cpu":
        return net
    from .backends import get_backend
    try:
        return net.to(get_backend(args.device))
    except Exception as e:  # no pyopencl, no device, a layer without kernels
        raise CommandError(f"--device {args.device}: {e}") from None


def _load(lm, path):
    if not Path(path).exists():
        raise CommandError(f"{path}: no such model file")
    if str(path).endswith(".json"):  # a network description: fresh parameters
        from .io import load_description
        return load_description(path)
    return lm.load(path)


def _is_text_model(net):
    return "vocabulary" in net.assets and "lstm" in [layer.name for layer in net.layers]


def _save_npz(path, outputs):
    import lamina as lm
    arrays = {}
    for name, value in outputs.items():
        if isinstance(value, lm.Sequences):
            arrays[name], arrays[f"{name}.starts"] = value.values, value.starts
        else:
            arrays[name] = value
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _describe(value):
    import lamina as lm
    if isinstance(value, lm.Sequences):
        return f"{value.num_sequences} sequences, {value.values.shape[0]} rows of {list(value.values.shape[1:])}"
    return f"{value.dtype} {list(value.shape)}"


# ---------------------------------------------------------------------------- commands

def cmd_infer(args):
    lm = _setup(args)
    net = _place(_load(lm, args.model), args)
    if _is_text_model(net) and (args.text is not None or (args.input and not args.input.endswith(".npz"))):
        from .zoo import language
        text = args.text if args.text is not None else Path(args.input).read_text(encoding="utf-8")
        tok = language.tokenizer(net)
        ids = tok.encode(text)
        if len(ids) >= 2:
            ppl = language.perplexity(net, language.chunk(ids, 48))
            print(f"perplexity of the input ({len(ids)} tokens): {ppl:.2f}")
        source, seconds = language.continue_code(net, text, tokens=args.tokens, seed=args.seed)
        print(f"the input continued by {args.tokens} tokens ({seconds * 1e3:.2f} ms per token):")
        print(source)
        return 0
    if not args.input:
        raise CommandError("infer needs an INPUT .npz (or --text for a text model)")
    from .io.arrays import load_feeds
    feeds = load_feeds(net, args.input)
    outputs = net.run(feeds)
    if args.output:
        _save_npz(args.output, outputs)
        print(f"wrote {args.output}: {', '.join(outputs)}")
    else:
        with np.printoptions(precision=4, suppress=True, threshold=20, edgeitems=3):
            for name, value in outputs.items():
                print(f"{name}: {_describe(value)}")
                print(getattr(value, "values", value))
    return 0


def _optimizer(lm, net, args):
    kinds = {"adam": lm.optim.Adam, "adamw": lm.optim.AdamW, "sgd": lm.optim.SGD,
             "adagrad": lm.optim.AdaGrad, "rmsprop": lm.optim.RMSProp}
    kw = {"momentum": args.momentum} if args.optimizer == "sgd" else {}
    return kinds[args.optimizer](net, lr=args.lr, **kw)


def cmd_train(args):
    lm = _setup(args)
    from . import training
    folder = Path(args.checkpoint_dir)
    ck = training.resume_from(folder) if args.resume else None
    net = _place(ck.net if ck else _load(lm, args.model), args)
    for name in args.freeze:
        try:
            net.freeze(name)
        except KeyError as e:
            raise CommandError(f"--freeze: {e.args[0]}") from None
    if _is_text_model(net) and not all(str(d).endswith(".npz") for d in args.data):
        data = training.TextData(net, args.data)
    elif len(args.data) == 1:
        data = training.ArrayData(net, args.data[0])
    else:
        raise CommandError("train takes one .npz data file (or source files for a text model)")
    opt = _optimizer(lm, net, args)
    if ck:
        ck.restore(opt)
        if net.backend.name != "cpu":  # the restored state is host arrays: move it along
            net.to(net.backend)
        print(f"resuming from {folder / training.CHECKPOINT}: epoch {ck.fields['epoch']}, "
              f"batch {ck.fields['batch']}, step {ck.step_count}")
    print(f"training {args.model} on {len(data)} samples: {args.epochs} epoch(s) of batches of "
          f"{args.batch_size}, {args.optimizer} lr {args.lr}")
    try:
        losses = training.fit(net, data, opt, epochs=args.epochs, batch_size=args.batch_size, folder=folder,
                              resume=ck, seed=args.seed, progress=not args.quiet, max_steps=args.max_steps)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    out = args.out or (args.model if not args.model.endswith(".json") else args.model[:-5] + ".lamina")
    lm.save(net, out)
    if losses:
        print(f"final loss {np.mean(losses[-20:]):.4f} after {len(losses)} steps; wrote {out}")
    print(f"log {folder / 'log.jsonl'}, loss curve {folder / 'loss.png'}, checkpoint {folder / training.CHECKPOINT}")
    return 0


def cmd_inspect(args):
    lm = _setup(args)
    net = _load(lm, args.model)
    from .io.model import FORMAT, VERSION, _read
    metadata, tensors = _read(args.model)
    dtypes = sorted({str(t.dtype) for k, t in tensors.items() if not k.startswith(("asset/", "optim/"))})
    print(f"{args.model}: format {FORMAT} version {VERSION}, {os.path.getsize(args.model) / 1e6:.2f} MB, "
          f"parameters stored as {', '.join(dtypes) or '-'}{', checkpoint' if 'checkpoint' in metadata else ''}")
    print("inputs: " + ", ".join(f"{n} {net.values[n].spec}" for n in net.input_names))
    print("outputs: " + ", ".join(f"{o} ({v})" for o, v in net.output_values.items()))
    print(net.summary())
    trainable = sum(p.size for p in net.parameters() if not p.frozen)
    print(f"{trainable} trainable")
    if (args.device or "cpu") != "cpu":
        _place(net, args)
        print(f"places on {net.backend}")
    if net.assets:
        shown = {k: (f"array {list(v.shape)}" if isinstance(v, np.ndarray) else
                     f"list of {len(v)}" if isinstance(v, list) else v) for k, v in net.assets.items()}
        print("assets: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return 0


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cmd_devices(args):
    lm = _setup(args)
    from importlib.metadata import PackageNotFoundError, version
    from .backends.blas import default_provider

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"
    print(f"cpu: {_cpu_name()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
          f"{lm.get_num_threads()} threads")
    print(f"     BLAS {default_provider()} (MKL {ver('mkl')}, OpenBLAS {ver('scipy-openblas32')}; "
          f"LAMINA_BLAS=mkl|openblas to choose)")
    try:
        import pyopencl as cl
    except ImportError:
        print("opencl: pyopencl is not installed, no OpenCL devices listed")
        return 0
    from .backends.opencl import devices
    found = devices()
    for n, dev in enumerate(found):
        print(f"opencl:{n}: {dev.name.strip()} ({cl.device_type.to_string(dev.type)}, {dev.platform.name.strip()}, "
              f"{dev.max_compute_units} compute units, {dev.global_mem_size / 2**30:.1f} GiB"
              f"{', float64' if dev.double_fp_config else ''})")
    if not found:
        print("opencl: no devices")
    return 0


def cmd_bench(args):
    _setup(args)
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "__main__.py").exists():
        raise CommandError(f"the benchmarks live in the source tree's bench/ folder, not found beside {root}")
    cmd = [sys.executable, "-m", "bench", *args.suites]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return subprocess.call(cmd, cwd=root)


# ---------------------------------------------------------------------------- parser

def parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cpu", help="cpu (default) or opencl[:N]")
    common.add_argument("--threads", type=int, default=None, help="threads for kernels and BLAS")
    p = argparse.ArgumentParser(prog="lamina", description="A compact deep-learning runtime: run, "
                                "fine-tune and inspect lamina models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("infer", parents=[common], help="run a model on inputs")
    s.add_argument("model")
    s.add_argument("input", nargs="?", help=".npz of arrays named after the inputs (text models: a source file)")
    s.add_argument("--output", "-o", help="write the outputs to this .npz instead of printing them")
    s.add_argument("--text", help="text models: the prompt to score and continue")
    s.add_argument("--tokens", type=int, default=40, help="text models: tokens to generate")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=cmd_infer)

    s = sub.add_parser("train", parents=[common], help="fine-tune a model")
    s.add_argument("model", help="a model file, or a .json network description to train from scratch")
    s.add_argument("data", nargs="+", help=".npz of arrays named after the inputs (text models: source files)")
    s.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "adagrad", "rmsprop"], default="adam")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--momentum", type=float, default=0.0, help="sgd only")
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    s.add_argument("--freeze", nargs="*", default=[], help="layers or parameters to keep fixed")
    s.add_argument("--checkpoint-dir", default="lamina-run", help="checkpoints, log.jsonl and loss.png")
    s.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    s.add_argument("--out", help="where to save the trained model (default: over MODEL)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(run=cmd_train)

    s = sub.add_parser("inspect", parents=[common], help="describe a model file")
    s.add_argument("model")
    s.set_defaults(run=cmd_inspect)

    s = sub.add_parser("devices", parents=[common], help="list the CPU and OpenCL devices")
    s.set_defaults(run=cmd_devices)

    s = sub.add_parser("bench", parents=[common], help="run the benchmarks (bench/)")
    s.add_argument("suites", nargs="*")
    s.set_defaults(run=cmd_bench)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from .errors import GraphError, InputError
    from .io.model import ModelFileError
    try:
        return args.run(args)
    except (CommandError, ModelFileError, InputError, GraphError) as e:
        print(f"lamina {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
