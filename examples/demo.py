"""`make demo`: load the three shipped models and run them on the CPU, and on an OpenCL device
where one exists and lamina has kernels for every layer, then fine-tune the language model for a
few steps on a file of your choice.

    .venv/bin/python examples/demo.py [--file SOURCE.py] [--steps 30]

1. models/python_lm: continue a prompt of Python code (time per token), and the held-out
   perplexity on the standard library files it never saw in training;
2. models/denoise3d: denoise held-out synthetic volumes, PSNR before and after, a PNG of slices;
3. models/line_kind: a transformer encoder names the kind of statement each line of the prompt
   starts, and its accuracy on held-out standard-library lines (a ragged batch, no padding);
4. fine-tune the language model on SOURCE.py (default: the standard library's json/decoder.py,
   part of its training data; pass your own file) with the progress bar of `lamina train`.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import lamina as lm
from lamina.cli import main as lamina_command
from lamina.zoo import denoise, language, lines

ROOT = Path(__file__).resolve().parent.parent
PROMPT = '''class Node:
    def __init__(self, name, parent=None):
        self.name = name
'''


def opencl_device():
    """lamina's OpenCL backend on the default device, or None (with the reason printed)."""
    try:
        from lamina.backends.opencl import OpenCLBackend, devices
        if not devices():
            print("no OpenCL device: everything runs on the CPU")
            return None
        return OpenCLBackend()
    except Exception as e:  # no pyopencl, no platform
        print(f"no OpenCL device ({e}): everything runs on the CPU")
        return None


def on_device(path, device):
    """The model at path placed on the OpenCL device, or None (saying which layers lack kernels)."""
    if device is None:
        return None
    try:
        return lm.load(path).to(device)
    except lm.GraphError as e:
        print(f"OpenCL ({device.device.name.strip()}): {path.parent.name} stays on the CPU: {e}")
        return None


def language_model(path, held_chunks, device):
    net = lm.load(path)
    print(f"== {path.relative_to(ROOT)}: {sum(p.size for p in net.parameters()):,} parameters, "
          f"{os.path.getsize(path) / 1e6:.1f} MB")
    source, seconds = language.continue_code(net, PROMPT, tokens=40, top_k=3, temperature=0.7)
    print(f"prompt + 40 generated tokens ({seconds * 1e3:.2f} ms per token on the CPU):")
    print("    | " + source.replace("\n", "\n    | "))
    start = time.perf_counter()
    ppl = language.perplexity(net, held_chunks)
    tokens = sum(len(c) - 1 for c in held_chunks)
    print(f"held-out perplexity {ppl:.2f} over {tokens} tokens of standard-library files not trained on "
          f"({tokens / (time.perf_counter() - start):,.0f} tokens/s); the card says "
          f"{net.assets.get('held_out_perplexity', float('nan')):.2f} on the full held-out set")
    dev = on_device(path, device)
    if dev is not None:
        name = device.device.name.strip()
        source_cl, seconds_cl = language.continue_code(dev, PROMPT, tokens=40, top_k=3, temperature=0.7)
        some = held_chunks[:100]
        ppl_cpu, ppl_cl = language.perplexity(net, some), language.perplexity(dev, some)
        print(f"on OpenCL ({name}): {seconds_cl * 1e3:.2f} ms per token, "
              f"{'the same' if source_cl == source else 'a different'} continuation; perplexity on "
              f"{sum(len(c) - 1 for c in some)} held-out tokens {ppl_cl:.4f} (CPU {ppl_cpu:.4f})")


def denoiser(path, out_png, device):
    net = lm.load(path)
    print(f"== {path.relative_to(ROOT)}: {sum(p.size for p in net.parameters()):,} parameters")
    clean = denoise.shapes(16, np.random.default_rng(1))
    noisy = denoise.noisy_copy(clean, np.random.default_rng(2))
    start = time.perf_counter()
    out = net.run({"noisy": noisy}, ["denoised"])["denoised"]
    ms = (time.perf_counter() - start) * 1e3 / len(clean)
    before, after = denoise.psnr(noisy, clean), denoise.psnr(out, clean)
    denoise.save_slices_png(out_png, noisy[:3], out[:3], clean[:3], f"held out: {before:.1f} dB -> {after:.1f} dB")
    print(f"PSNR on 16 held-out {denoise.SIZE}³ volumes: noisy {before:.2f} dB -> denoised {after:.2f} dB "
          f"({ms:.1f} ms per volume); slices in {out_png}")
    dev = on_device(path, device)
    if dev is not None:
        start = time.perf_counter()
        out_cl = dev.run({"noisy": noisy}, ["denoised"])["denoised"]
        ms_cl = (time.perf_counter() - start) * 1e3 / len(clean)
        print(f"on OpenCL ({device.device.name.strip()}): denoised {denoise.psnr(out_cl, clean):.2f} dB "
              f"({ms_cl:.1f} ms per volume), largest difference from the CPU {np.abs(out_cl - out).max():.1e}")


def line_classifier(path, held_files, device):
    net = lm.load(path)
    tok = language.tokenizer(net)
    print(f"== {path.relative_to(ROOT)}: {sum(p.size for p in net.parameters()):,} parameters, a transformer encoder")
    prompt = [line.strip() for line in PROMPT.splitlines() if line.strip()]
    for line, kind in zip(prompt, lines.predict(net, lines.encode(tok, prompt))):
        print(f"    {lines.KINDS[kind]:>16} | {line}")
    held = lines.held_out_sample(lines.labelled_lines(language.read_texts(held_files)), 2000)
    ids, truth = lines.encode(tok, [line for line, _ in held]), np.array([kind for _, kind in held])
    start = time.perf_counter()
    predicted = lines.predict(net, ids)
    seconds = time.perf_counter() - start
    print(f"held-out accuracy {np.mean(predicted == truth):.4f} on {len(held)} lines of a quarter of the held-out "
          f"files ({len(held) / seconds:,.0f} lines/s, batches of up to 1024 packed without padding); the card "
          f"says {net.assets.get('held_out_accuracy', float('nan')):.4f} on 5000 lines of them all")
    dev = on_device(path, device)
    if dev is not None:
        on_cl = lines.predict(dev, ids[:500])
        print(f"on OpenCL ({device.device.name.strip()}): {np.mean(on_cl == predicted[:500]):.4f} of 500 lines "
              f"classified as on the CPU")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", help="a Python source file to fine-tune the language model on")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out_dir = ROOT / "build" / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    lm_path, dn_path = ROOT / "models/python_lm/model.lamina", ROOT / "models/denoise3d/model.lamina"
    print(f"lamina {lm.__version__}, {lm.get_num_threads()} threads")
    device = opencl_device()

    _, held = language.stdlib_split()
    net = lm.load(lm_path)
    tok = language.tokenizer(net)
    chunks = [c for t in language.read_texts(held[::4]) for c in language.chunk(tok.encode(t), 48)][:800]
    language_model(lm_path, chunks, device)
    print()
    denoiser(dn_path, out_dir / "denoise_slices.png", device)
    print()
    line_classifier(ROOT / "models/line_kind/model.lamina", held[::4], device)
    print()

    import json as json_module
    source = Path(args.file) if args.file else Path(json_module.__file__).with_name("decoder.py")
    tuned = out_dir / "python_lm_tuned.lamina"
    print(f"== fine-tuning the language model on {source} for {args.steps} steps "
          f"(`lamina train {lm_path.relative_to(ROOT)} {source} ...`)")
    run = out_dir / "finetune"
    if (run / "log.jsonl").exists():
        (run / "log.jsonl").unlink()  # a fresh log for this run
    code = lamina_command(["train", str(lm_path), str(source), "--lr", "5e-4", "--batch-size", "16",
                           "--epochs", "100", "--max-steps", str(args.steps), "--checkpoint-dir", str(run),
                           "--out", str(tuned)])
    if code:
        sys.exit(code)
    log = [json.loads(line) for line in open(run / "log.jsonl")]
    print(f"sampled-softmax loss {np.mean([e['loss'] for e in log[:5]]):.3f} (first 5 steps) -> "
          f"{np.mean([e['loss'] for e in log[-5:]]):.3f} (last 5); tuned model in {tuned}")


if __name__ == "__main__":
    main()
