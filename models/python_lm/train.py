"""Trains models/python_lm/model.lamina: a token-level language model of Python source, on the
Python standard library's own .py files (every machine with Python has them).

Data: every .py file under the standard library (test suites, site-packages and idlelib left
out), in sorted order; a file goes to the held-out set when crc32 of its relative path is 0 mod
10. Tokens: lamina.text (names, keywords, operators; numbers and strings folded; layout kept),
vocabulary = the 4096 most frequent training tokens. Chunks of 48 tokens, batches of 32.
Model: Embedding(4096, 64) -> LSTM(64, 256) -> SelectiveLinear(256, 4096), trained with sampled
softmax (128 log-uniform negatives per token, logQ correction), Adam 2e-3 with cosine decay.
Held-out perplexity is measured with the full softmax.

    .venv/bin/python models/python_lm/train.py [--minutes 8] [--out models/python_lm/model.lamina]
"""
import argparse
import json
import os
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

import lamina as lm
from lamina.text import PythonTokenizer
from lamina.zoo import language

HERE = Path(__file__).resolve().parent
VOCAB, CHUNK, BATCH, NEGATIVES = 4096, 48, 32, 128
SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIP & set(p.relative_to(root).parts))
    return root, files


def split(root, files):
    train, held = [], []
    for p in files:
        (held if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0 else train).append(p)
    return train, held


def read(paths):
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    parser.add_argument("--out", default=str(HERE / "model.lamina"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        lm.set_num_threads(args.threads)
    lm.manual_seed(0)
    rng = np.random.default_rng(0)
    root, files = stdlib_files()
    train_files, held_files = split(root, files)
    train_texts, held_texts = read(train_files), read(held_files)
    tok = PythonTokenizer.build(train_texts, VOCAB)
    train_chunks = [c for t in train_texts for c in language.chunk(tok.encode(t), CHUNK)]
    held_chunks = [c for t in held_texts for c in language.chunk(tok.encode(t), CHUNK)]
    held_eval = [held_chunks[i] for i in np.random.default_rng(1).permutation(len(held_chunks))[:2000]]
    print(f"{len(train_files)} training files ({sum(len(c) - 1 for c in train_chunks)} tokens), "
          f"{len(held_files)} held out ({sum(len(c) - 1 for c in held_chunks)} tokens)")

    net = language.build(VOCAB)
    net.assets = {"vocabulary": tok.vocabulary, "tokenizer": "lamina.text.PythonTokenizer"}
    budget = args.minutes * 60
    steps_guess = 4000
    opt = lm.optim.Adam(net, lr=2e-3, clip_norm=5.0,
                        schedule=lm.optim.CosineWarmup(100, steps_guess, min_factor=0.05))
    start, step, losses = time.perf_counter(), 0, []
    order = rng.permutation(len(train_chunks))
    bar = tqdm(total=steps_guess, unit="step")
    while time.perf_counter() - start < budget and step < steps_guess:
        pick = order[(step * BATCH) % len(order):(step * BATCH) % len(order) + BATCH]
        if len(pick) < BATCH:
            order = rng.permutation(len(train_chunks))
            continue
        loss = net.train_step(language.training_feeds(net, [train_chunks[i] for i in pick], NEGATIVES, rng), opt)
        losses.append(loss)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    bar.close()
    minutes = (time.perf_counter() - start) / 60
    ppl = language.perplexity(net, held_eval)
    print(f"{step} steps in {minutes:.1f} min; held-out perplexity {ppl:.2f} "
          f"({sum(len(c) - 1 for c in held_eval)} tokens, full softmax)")
    net.assets.update(held_out_perplexity=ppl, training_steps=step, training_minutes=round(minutes, 1))
    lm.save(net, args.out, half=True)
    (HERE / "metrics.json").write_text(json.dumps({
        "steps": step, "minutes": round(minutes, 1), "held_out_perplexity": round(ppl, 3),
        "held_out_tokens": int(sum(len(c) - 1 for c in held_eval)), "vocabulary": VOCAB,
        "train_files": len(train_files), "held_out_files": len(held_files),
        "final_train_loss": round(float(np.mean(losses[-100:])), 4),
        "size_bytes": os.path.getsize(args.out)}, indent=1) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
