"""The `lamina` command: infer, train, inspect, devices, bench.

    lamina infer MODEL INPUT [--output OUT.npz]     run a model on an .npz (or, for a text model,
                                                    a source file or --text) and print or save
    lamina train MODEL DATA [--epochs ...]          fine-tune on an .npz (or source files)
    lamina quantize MODEL -o OUT [--dtype int8]     a copy that multiplies in int8 (or bfloat16)
    lamina inspect MODEL                            layers, shapes, parameters, format version
    lamina devices                                  the CPU and every OpenCL device
    lamina serve [NAME=]MODEL ... [--port P]        serve models over HTTP (KServe v2), batching
    lamina bench [SUITE ...]                        the benchmarks of bench/

Every command takes --device cpu|opencl[:N] and --threads N.
"""
import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from .precision import PRECISIONS

EXIT_INTERRUPTED = 130
DTYPE_HELP = ("how inference multiplies by the weights (default: as the model file says); bfloat16: bfloat16 "
              "products, float32 accumulation; int8: dynamic quantization (int8 weights, u8 activations)")


class CommandError(Exception):
    """A user mistake the command reports in one line (exit status 2)."""


class _ShowDefaults(argparse.HelpFormatter):
    """--help shows each option's default (where it has one)."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if shown and "%(default)" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line ('lamina train: argument --lr: ...') and
    shows every option's default in --help."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kw)

    def error(self, message):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _number(kind, low=None, high=None, low_open=False, what=None):
    """An argparse type: a finite int or float within [low, high] (open at low if low_open)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        import math
        bad = (not math.isfinite(v) or (low is not None and (v <= low if low_open else v < low))
               or (high is not None and v > high))
        if bad:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}")
        return v
    return parse


POSITIVE_INT = _number(int, 1, what="a positive integer")
POSITIVE = _number(float, 0, low_open=True, what="a finite positive number")


# ---------------------------------------------------------------------------- helpers

def _setup(args):
    import lamina as lm
    from .threads import check_environment
    check_environment()
    if args.threads is not None:
        if args.threads < 1:
            raise CommandError(f"--threads must be at least 1, found {args.threads}")
        lm.set_num_threads(args.threads)
    device = args.device or "cpu"
    if device != "cpu" and device.split(":")[0] != "opencl":
        raise CommandError(f"--device must be cpu or opencl[:N], found {device!r}")
    return lm


def _place(net, args):
    """Put a loaded network on the --device (OpenCL errors become one clear line), multiplying
    in the --dtype where the command has one."""
    dtype = getattr(args, "dtype", None)
    if dtype is not None:
        try:
            net.set_precision(dtype)
        except ValueError as e:
            raise CommandError(f"--dtype {dtype}: {e}") from None
    if (args.device or "cpu") == "cpu":
        return net
    from .backends import get_backend
    try:
        return net.to(get_backend(args.device))
    except Exception as e:  # no pyopencl, no device, a layer without kernels
        raise CommandError(f"--device {args.device}: {e}") from None


def _load(lm, path, constants=None):
    """A network from a model file, a description (.json) or an ONNX file (with `constants`:
    inputs fixed at import)."""
    if not Path(path).exists():
        raise CommandError(f"{path}: no such model file")
    if str(path).endswith(".json"):  # a network description: fresh parameters
        from .io import load_description
        return load_description(path)
    if str(path).endswith(".onnx"):
        try:
            return lm.onnx.load(path, constants=constants)
        except ImportError as e:
            raise CommandError(str(e)) from None
    return lm.load(path)


def _is_text_model(net):
    return "vocabulary" in net.assets and "lstm" in [layer.name for layer in net.layers]


def _writable(path, what):
    """Refuse, before any work, an output path whose folder does not exist."""
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise CommandError(f"{what} {path}: the folder {folder} does not exist")
    if Path(path).is_dir():
        raise CommandError(f"{what} {path}: is a folder, expected a file name")


def _save_npz(path, outputs):
    import io
    import lamina as lm
    from .io.model import write_atomic
    arrays = {}
    for name, value in outputs.items():
        if isinstance(value, lm.Sequences):
            arrays[name], arrays[f"{name}.starts"] = value.values, value.starts
        else:
            arrays[name] = value
    blob = io.BytesIO()
    np.savez(blob, **arrays)
    write_atomic(path, blob.getvalue())  # a temporary file in the same folder, renamed: no leftovers


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
    if args.output:
        _writable(args.output, "--output")
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
    return kinds[args.optimizer](net, lr=args.lr, nonfinite=args.nonfinite, **kw)


def _stored_half(path):
    """Whether a model file stores its parameters as float16 (a trained copy keeps that)."""
    if str(path).endswith((".json", ".onnx")):
        return False
    from .io.model import _read
    _, tensors = _read(path)
    from .io.model import stored_types
    return stored_types(tensors) == ["float16"]


def _world(args):
    """The MPI job's World when training is data-parallel (--distributed, or started by an MPI
    launcher), else None. Ranks that share a machine split its cores unless --threads says."""
    from . import distributed
    if not (args.distributed or distributed.launched()):
        return None
    world = distributed.init()
    if args.threads is None and "LAMINA_THREADS" not in os.environ:
        local = next((int(os.environ[v]) for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
                      if v in os.environ), 1)
        from .threads import set_num_threads
        set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    return world


def cmd_train(args):
    lm = _setup(args)
    world = _world(args)
    lead = world is None or world.rank == 0  # prints, reads the checkpoint, writes the files
    say = print if lead else (lambda *a, **k: None)
    from . import training
    from .io.checkpoint import graph_difference
    folder = Path(args.checkpoint_dir)
    if folder.exists() and not folder.is_dir():
        raise CommandError(f"--checkpoint-dir {folder}: is a file, expected a folder")
    out = Path(args.out) if args.out else folder / "model.lamina"
    if out.resolve() == Path(args.model).resolve():
        raise CommandError(f"--out {out}: that is MODEL itself; lamina train never writes over its input "
                           f"model, name another file")
    if args.out:
        _writable(out, "--out")
    model = _load(lm, args.model)
    half = _stored_half(args.model)
    # rank 0 reads the checkpoint and hands its state to the others (lamina.distributed), so
    # only its server needs --checkpoint-dir
    ck = training.resume_from(folder) if args.resume and lead else None
    if ck:
        differs = graph_difference(ck.net, model)
        if differs:
            raise CommandError(f"--resume: {folder / training.CHECKPOINT} is a checkpoint of another network "
                               f"than {args.model}: {differs}")
    net = _place(ck.net if ck else model, args)
    net.autocast(args.train_dtype)
    for name in args.freeze:
        try:
            net.freeze(name)
        except KeyError as e:
            raise CommandError(f"--freeze: {e.args[0]}") from None
    if _is_text_model(net) and not all(str(d).endswith(".npz") for d in args.data):
        data = training.TextData(net, args.data, shared_negatives=args.shared_negatives)
    elif len(args.data) == 1:
        data = training.ArrayData(net, args.data[0])
    else:
        raise CommandError("train takes one .npz data file (or source files for a text model)")
    try:
        opt = _optimizer(lm, net, args)
    except ValueError as e:
        raise CommandError(str(e)) from None
    if ck:
        ck.restore(opt)
        net.to(net.backend)  # the restored state is host arrays: onto the network's device
        print(f"resuming from {folder / training.CHECKPOINT}: epoch {ck.fields['epoch']}, "
              f"batch {ck.fields['batch']}, step {ck.step_count}")
    resume = ck.fields if ck else None
    if world is not None:
        from . import distributed
        resume = world.broadcast(resume, "rank 0's checkpoint position")
        distributed.data_parallel(net, opt, world, bucket_mb=args.bucket_mb, seed=args.seed)
        say(f"data-parallel over {world.size} ranks ({lm.get_num_threads()} thread(s) each), "
            f"global batches of {args.batch_size}")
    say(f"training {args.model} on {len(data)} samples: {args.epochs} epoch(s) of batches of "
        f"{args.batch_size}, {args.optimizer} lr {args.lr}")
    try:
        losses = training.fit(net, data, opt, epochs=args.epochs, batch_size=args.batch_size, folder=folder,
                              resume=resume, seed=args.seed, progress=not args.quiet, max_steps=args.max_steps,
                              checkpoint_every=args.checkpoint_every, world=world, log=say)
    except KeyboardInterrupt as e:
        return 128 + getattr(e, "signum", signal.SIGINT)  # 130 after Ctrl-C, 143 after SIGTERM
    if not lead:
        return 0
    if opt.skipped_steps:
        print(f"skipped {opt.skipped_steps} step(s) whose loss or gradient was not finite (NaN or infinity "
              f"in the data?)", file=sys.stderr)
    if not losses:
        print(f"lamina train: no step was applied, so no model was written ({args.model} is untouched)",
              file=sys.stderr)
        return 1
    lm.save(net, out, half=half)
    print(f"final loss {np.mean(losses[-20:]):.4f} after {len(losses)} steps; wrote {out}"
          f"{' (float16, as the input)' if half else ''}")
    print(f"log {folder / 'log.jsonl'}, loss curve {folder / 'loss.png'}, checkpoint {folder / training.CHECKPOINT}")
    return 0


def cmd_serve(args):
    _setup(args)
    from .serve import load_models, serve
    try:
        from .serve.protocol import Limits
        limits = Limits(args.max_sequence_length, args.max_rows, args.max_elements)
        models = load_models(args.models, 1 if args.no_batching else args.max_batch_size, args.max_delay_ms / 1e3,
                             args.max_queue, limits, int(args.max_batch_mb * 2 ** 20))
    except (ImportError, ValueError, OSError) as e:
        raise CommandError(str(e)) from None
    for spec in args.batching:
        name, size, delay = _batching(spec, models)
        models[name].max_batch_size = size
        if delay is not None:
            models[name].max_delay = delay / 1e3
    for m in models.values():
        m.net = _place(m.net, args)

    def ready(server):
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        grpc = f" and grpc://{host}:{server.grpc_port}" if server.grpc_port else ""
        print(f"serving at http://{host}:{port}{grpc}: " + "; ".join(
            f"{name} (batches of up to {m.max_batch_size}"
            + (f", {m.max_delay * 1e3:g} ms" if m.max_delay else "") + ")" for name, m in models.items()), flush=True)
    # The server catches SIGTERM and SIGINT while it runs (a graceful stop) and puts back the
    # handlers it found when it ends. Ignored ones are found: a second SIGTERM arriving while the
    # stopped process exits then leaves it to exit 0, where the default action killed it (143).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(models, args.host, args.port, args.timeout_ms / 1e3, int(args.max_body_mb * 2 ** 20), on_ready=ready,
          max_connections=args.max_connections, request_timeout=args.request_timeout_s, keep_alive=args.keep_alive_s,
          grpc_port=args.grpc_port)
    return 0


def _batching(spec, models):
    """(model name, max batch size, max delay in ms or None) from NAME=SIZE[:DELAY_MS]."""
    name, _, rest = spec.partition("=")
    if name not in models:
        raise CommandError(f"--batching {spec}: no model named '{name}'; models: {', '.join(models)}")
    size, _, delay = rest.partition(":")
    try:
        size, delay = int(size), (float(delay) if delay else None)
    except ValueError:
        raise CommandError(f"--batching {spec}: expected NAME=SIZE[:DELAY_MS], e.g. {name}=16:2") from None
    if size < 1 or (delay is not None and not 0 <= delay <= 10000):
        raise CommandError(f"--batching {spec}: SIZE must be at least 1 and DELAY_MS in [0, 10000]")
    return name, size, delay


def _constant(spec):
    """NAME=VALUE of --constant: VALUE a number, true/false, or a JSON list of numbers."""
    import json
    name, sep, text = spec.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        value = json.loads(text)
        if not isinstance(value, (bool, int, float, list)):
            raise ValueError
    except ValueError:
        raise CommandError(f"--constant {spec}: expected NAME=VALUE, VALUE a number, true/false or a JSON list "
                           f"(e.g. sr=16000)") from None
    return name, value


def cmd_import(args):
    lm = _setup(args)
    if not args.model.endswith(".onnx"):
        raise CommandError(f"{args.model}: expected an .onnx file")
    _writable(args.output, "--output")
    net = _load(lm, args.model, dict(_constant(spec) for spec in args.constant))
    lm.save(net, args.output)
    print(f"wrote {args.output}: {len(net.layers)} layers, {sum(p.size for p in net.parameters())} parameters")
    return 0


def cmd_quantize(args):
    lm = _setup(args)
    if args.output.endswith(".onnx"):
        raise CommandError(f"--output {args.output}: quantize writes a lamina model file; export it to ONNX after")
    _writable(args.output, "--output")
    net = _load(lm, args.model)
    net.set_precision(args.dtype)
    lm.save(net, args.output)
    stored = sum(p.size for layer in net.layers for p in map(layer.params.get, layer.product_weights()))
    print(f"wrote {args.output}: {stored} weights stored in {args.dtype}; at inference its Linear and recurrent "
          f"products multiply in {args.dtype} (convolutions in float32 over those weights)")
    return 0


def cmd_export(args):
    lm = _setup(args)
    if not args.output.endswith(".onnx"):
        raise CommandError(f"--output {args.output}: expected an .onnx file name")
    _writable(args.output, "--output")
    net = _load(lm, args.model)
    try:
        model = lm.onnx.save(net, args.output, args.outputs)
    except ImportError as e:
        raise CommandError(str(e)) from None
    print(f"wrote {args.output}: {len(model.graph.node)} ONNX nodes (opset {model.opset_import[0].version}), "
          f"outputs {', '.join(o.name for o in model.graph.output)}")
    return 0


def cmd_inspect(args):
    lm = _setup(args)
    net = _load(lm, args.model)
    if args.model.endswith(".onnx"):
        print(f"{args.model}: ONNX, {os.path.getsize(args.model) / 1e6:.2f} MB, imported as lamina layers")
    else:
        from .io.model import FORMAT, _read
        metadata, tensors = _read(args.model)
        from .io.model import stored_types
        dtypes = stored_types(tensors)
        print(f"{args.model}: format {FORMAT} version {metadata['version']}, "
              f"{os.path.getsize(args.model) / 1e6:.2f} MB, "
              f"parameters stored as {', '.join(dtypes) or '-'}{', checkpoint' if 'checkpoint' in metadata else ''}")
    print("inputs: " + ", ".join(f"{n} {net.values[n].spec}" for n in net.input_names))
    print("outputs: " + ", ".join(f"{o} ({v})" for o, v in net.output_values.items()))
    print(net.summary())
    trainable = sum(p.size for p in net.parameters() if not p.frozen)
    print(f"{trainable} trainable")
    if (args.device or "cpu") != "cpu":
        _place(net, args)
        print(f"places on {net.backend}")
    for node in net.validate():
        if hasattr(node.layer, "algorithms"):
            steps = node.layer.algorithms(net.backend)
            print(f"{node.name} runs on {net.backend.name} as " + ", ".join(f"{k}: {v}" for k, v in steps.items()))
    if net.assets:
        shown = {k: (f"array {list(v.shape)}" if isinstance(v, np.ndarray) else
                     f"list of {len(v)}" if isinstance(v, list) else v) for k, v in net.assets.items()}
        print("assets: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return 0


def cmd_devices(args):
    lm = _setup(args)
    from importlib.metadata import PackageNotFoundError, version
    from .backends.cpu.blas import available, default_provider, low_precision_products

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"
    from . import processor as cpu
    print(f"cpu: {cpu.model_name()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
          f"{lm.get_num_threads()} threads")
    print(f"     instruction sets: {' '.join(cpu.instruction_sets()) or 'unknown'}")
    mkl = f"MKL {ver('mkl')}" if "mkl" in available() else "built without MKL"
    print(f"     BLAS {default_provider()} ({mkl}, OpenBLAS {ver('scipy-openblas32')}; "
          f"LAMINA_BLAS={'|'.join(available())} to choose)")
    from .backends.cpu import compiled
    for family, path in compiled.describe().items():
        print(f"     {family}: {path}")
    sets = set(cpu.instruction_sets())
    products = low_precision_products()
    bf16 = "float32 products of the operands rounded to bfloat16"
    int8 = "float32 products of the int8 weights and the activations snapped to their u8 grids"
    if products == "mkl":
        bf16 = "MKL's packed bfloat16 GEMM" + (" on AMX" if "amx_bf16" in sets else
                                               " on AVX512-BF16" if "avx512_bf16" in sets else "")
        int8 = "MKL's packed u8 x s8 GEMM" + (" on AMX" if "amx_int8" in sets else
                                             " on VNNI" if sets & {"avx512_vnni", "avx_vnni"} else
                                             " (activations in 127 steps: no int8 dot product)")
    elif products == "lamina":
        amx = compiled._kernels.amx_runs()
        if compiled._kernels.bf16_kernel_runs():
            bf16 = "lamina's bfloat16 panels, " + ("AMX tiles" if amx else "AVX512-BF16")
        kernel = ("AMX tiles" if amx else "AVX-512 VNNI" if compiled._kernels.int8_uses_vnni() else
                  "AVX2" if compiled._kernels.int8_uses_avx2() else "portable code")
        int8 = f"lamina's u8 x s8 panels, {kernel} (activations in 127 steps)"
    forced = " (forced)" if os.environ.get("LAMINA_LOW_PRECISION") else ""
    print(f"     bfloat16 products: {bf16}{forced}")
    print(f"     int8 products: {int8}{forced}; LAMINA_LOW_PRECISION=mkl|lamina|float32 to choose")
    print(f"     LAMINA_ISA={'|'.join(compiled.PATHS)} picks the kernels' path")
    try:
        import pyopencl as cl
    except ImportError:
        print("opencl: pyopencl is not installed, no OpenCL devices listed (pip install 'lamina[opencl]')")
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
    common = Parser(add_help=False)
    common.add_argument("--device", default="cpu", help="cpu or opencl[:N]")
    common.add_argument("--threads", type=POSITIVE_INT, default=None,
                        help="threads for kernels and BLAS (default: LAMINA_THREADS, else every usable core)")
    p = Parser(prog="lamina", description="A compact deep-learning runtime: run, "
               "fine-tune and inspect lamina models.")
    from . import __version__
    p.add_argument("--version", action="version", version=f"lamina {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    s = sub.add_parser("infer", parents=[common], help="run a model on inputs")
    s.add_argument("model")
    s.add_argument("input", nargs="?", help=".npz of arrays named after the inputs (text models: a source file)")
    s.add_argument("--output", "-o", help="write the outputs to this .npz instead of printing them")
    s.add_argument("--text", help="text models: the prompt to score and continue")
    s.add_argument("--tokens", type=POSITIVE_INT, default=40, help="text models: tokens to generate")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    s.add_argument("--dtype", choices=PRECISIONS, default=None, help=DTYPE_HELP)
    s.set_defaults(run=cmd_infer)

    s = sub.add_parser("train", parents=[common], help="fine-tune a model")
    s.add_argument("model", help="a model file, or a .json network description to train from scratch")
    s.add_argument("data", nargs="+", help=".npz of arrays named after the inputs (text models: source files)")
    s.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "adagrad", "rmsprop"], default="adam",
                   help="the optimizer")
    s.add_argument("--lr", type=POSITIVE, default=1e-3, help="learning rate")
    s.add_argument("--momentum", type=_number(float, 0, 0.999999, what="a number in [0, 1)"), default=0.0,
                   help="sgd only")
    s.add_argument("--epochs", type=POSITIVE_INT, default=1, help="passes over the data")
    s.add_argument("--batch-size", type=POSITIVE_INT, default=32, help="samples (sequences) per step")
    s.add_argument("--max-steps", type=POSITIVE_INT, default=None, help="stop after this many steps")
    s.add_argument("--checkpoint-every", type=POSITIVE_INT, default=None,
                   help="also write the checkpoint every N steps (it is always written at each epoch's end)")
    s.add_argument("--nonfinite", choices=["skip", "raise"], default="skip",
                   help="a step whose loss or gradient is NaN or infinite: skip it, or stop with an error")
    s.add_argument("--freeze", nargs="*", default=[], help="layers or parameters to keep fixed")
    s.add_argument("--checkpoint-dir", default="lamina-run", help="checkpoints, log.jsonl and loss.png")
    s.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    s.add_argument("--out", help="where to save the trained model (default: model.lamina in --checkpoint-dir; "
                   "never MODEL itself)")
    s.add_argument("--seed", type=int, default=0, help="seed of the data order and sampling")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--dtype", dest="train_dtype", choices=["float32", "bfloat16"], default="float32",
                   help="how training multiplies: bfloat16 rounds both operands of the Linear and recurrent "
                        "products (forward and backward) and sums in float32; the weights stay float32")
    s.add_argument("--shared-negatives", action="store_true",
                   help="text models: draw the sampled-softmax negatives once per batch (per rank) instead of per "
                        "token; data-parallel runs then exchange far fewer output rows")
    s.add_argument("--distributed", action="store_true",
                   help="data-parallel over MPI (implied when started by mpiexec): --batch-size is the global batch")
    s.add_argument("--bucket-mb", type=POSITIVE, default=4.0,
                   help="data-parallel: gradient megabytes per allreduce")
    s.set_defaults(run=cmd_train)

    s = sub.add_parser("serve", parents=[common], help="serve models over HTTP (Open Inference Protocol)")
    s.add_argument("models", nargs="+", metavar="[NAME=]MODEL",
                   help="model files (.lamina or .onnx); NAME defaults to the file's stem (the folder's name for "
                        "model.lamina)")
    s.add_argument("--dtype", choices=PRECISIONS, default=None, help=DTYPE_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_number(int, 0, 65535, what="a port in [0, 65535]"), default=8000,
                   help="port to listen on (0: any free port, printed)")
    s.add_argument("--max-batch-size", type=POSITIVE_INT, default=32, help="requests per batch at most")
    s.add_argument("--max-delay-ms", type=_number(float, 0, 10000, what="milliseconds in [0, 10000]"), default=0.0,
                   help="how long a batch waits for more requests after its first (0: it starts as soon as the "
                        "model is free, with what queued meanwhile)")
    s.add_argument("--batching", action="append", default=[], metavar="NAME=SIZE[:DELAY_MS]",
                   help="one model's own batch size and delay (repeatable)")
    s.add_argument("--no-batching", action="store_true", help="run every request alone")
    s.add_argument("--timeout-ms", type=POSITIVE, default=10000.0,
                   help="a request not answered within this gets 504")
    s.add_argument("--max-queue", type=POSITIVE_INT, default=1024, help="queued requests per model before 503")
    s.add_argument("--max-body-mb", type=POSITIVE, default=64.0, help="largest request body accepted")
    s.add_argument("--max-sequence-length", type=POSITIVE_INT, default=4096,
                   help="steps one request's sequence may hold (413 past it)")
    s.add_argument("--max-rows", type=POSITIVE_INT, default=1024,
                   help="rows (or sequences) one request's inputs may hold (413 past it)")
    s.add_argument("--max-elements", type=POSITIVE_INT, default=1 << 22,
                   help="values all of one request's inputs may hold together (413 past it)")
    s.add_argument("--max-batch-mb", type=POSITIVE, default=512.0,
                   help="buffer memory one batch may take, as the network's plan lays it out: a batch closes "
                        "before it, and a request that alone needs more gets 413")
    s.add_argument("--max-connections", type=POSITIVE_INT, default=1000,
                   help="connections served at once (503 past it)")
    s.add_argument("--request-timeout-s", type=POSITIVE, default=30.0,
                   help="seconds a connection has to send a whole request (headers and body) before it is closed")
    s.add_argument("--grpc-port", type=_number(int, 0, 65535, what="a port in [0, 65535]"), default=None,
                   help="serve the protocol's gRPC service on this port too (0: any free port, printed)")
    s.add_argument("--keep-alive-s", type=POSITIVE, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    s.set_defaults(run=cmd_serve)

    s = sub.add_parser("import", parents=[common], help="convert an ONNX model to a lamina model file")
    s.add_argument("model", help="an .onnx file")
    s.add_argument("--output", "-o", required=True, help="the lamina model file to write")
    s.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                   help="fix the model input NAME at VALUE (a number, true/false or a JSON list) at import: "
                        "scalar inputs, flags, and the If branches they choose fold away (repeatable)")
    s.set_defaults(run=cmd_import)

    s = sub.add_parser("quantize", parents=[common],
                       help="write a copy of a model that multiplies by its weights in int8 (or bfloat16)")
    s.add_argument("model", help="a lamina model file, or an .onnx file")
    s.add_argument("--output", "-o", required=True, help="the lamina model file to write")
    s.add_argument("--dtype", choices=[p for p in PRECISIONS if p != "float32"], default="int8",
                   help="int8: dynamic quantization (int8 weights per output channel, u8 activations per row); "
                        "bfloat16: bfloat16 weights and products, float32 accumulation")
    s.set_defaults(run=cmd_quantize)

    s = sub.add_parser("export", parents=[common], help="write a model's inference graph as ONNX")
    s.add_argument("model", help="a lamina model file")
    s.add_argument("--output", "-o", required=True, help="the .onnx file to write")
    s.add_argument("--outputs", nargs="+", metavar="NAME",
                   help="the outputs to export (default: every output inference computes); the ONNX model's inputs "
                        "are what these need")
    s.set_defaults(run=cmd_export)

    s = sub.add_parser("inspect", parents=[common], help="describe a model file")
    s.add_argument("model")
    s.set_defaults(run=cmd_inspect)

    s = sub.add_parser("devices", parents=[common], help="list the CPU and OpenCL devices")
    s.set_defaults(run=cmd_devices)

    s = sub.add_parser("bench", parents=[common], help="run the benchmarks (bench/)")
    s.add_argument("suites", nargs="*")
    s.set_defaults(run=cmd_bench)
    return p


def _fail(args, error, code):
    """Report an error in one line and return the exit status; in a job of several MPI ranks,
    end every rank (the others would wait for this one forever)."""
    from . import distributed
    world = distributed._world
    if world is not None and world.size > 1:
        world.abort(f"lamina {args.command}: {error}", code)
    print(f"lamina {args.command}: {error}", file=sys.stderr)
    return code


def main(argv=None):
    args = parser().parse_args(argv)
    from .models import resolve  # a shipped model's name stands for its file: lamina infer python_lm
    if isinstance(getattr(args, "model", None), str):
        args.model = resolve(args.model)
    from .errors import GraphError, InputError
    from .io.model import ModelFileError, NonFiniteModelError
    from .sequence import SequenceError
    from .extras import MissingExtra
    from .threads import SettingError
    try:
        return args.run(args)
    except (CommandError, ModelFileError, InputError, GraphError, SequenceError, SettingError, MissingExtra) as e:
        return _fail(args, e, 2)
    except (FloatingPointError, NonFiniteModelError) as e:
        return _fail(args, e, 1)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the output's reader went away (`lamina inspect M | head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
