"""Trains models/python_lm/model.lamina: a token-level language model of Python source, on the
Python standard library's own .py files (every machine with Python has them).

Data: every .py file under the standard library (test suites, site-packages and idlelib left
out), in sorted order; a file goes to the held-out set when crc32 of its relative path is 0 mod
10. Tokens: lamina.text (names, keywords, operators; numbers and strings folded; layout kept),
vocabulary = the 4096 most frequent training tokens. Chunks of 48 tokens, batches of 32.
Model: Embedding(4096, 64) -> LSTM(64, 256) -> SelectiveLinear(256, 4096), trained with sampled
softmax (128 log-uniform negatives per token, logQ correction), Adam 2e-3 with cosine decay.
Held-out perplexity is measured with the full softmax.

    .venv/bin/python models/python_lm/train.py [--steps 3000] [--out models/python_lm/model.lamina]
"""
import time
from pathlib import Path

import numpy as np

import lamina as lm
from lamina.text import PythonTokenizer
from lamina.training import Samples, fit
from lamina.zoo import language, script_options, write_metrics

HERE = Path(__file__).resolve().parent
VOCAB, CHUNK, BATCH, NEGATIVES = 4096, 48, 32, 128
def main():
    args = script_options(__doc__, 3000, HERE / "model.lamina")
    train_files, held_files = language.stdlib_split()
    train_texts, held_texts = language.read_texts(train_files), language.read_texts(held_files)
    tok = PythonTokenizer.build(train_texts, VOCAB)
    train_chunks = [c for t in train_texts for c in language.chunk(tok.encode(t), CHUNK)]
    held_chunks = [c for t in held_texts for c in language.chunk(tok.encode(t), CHUNK)]
    held_eval = [held_chunks[i] for i in np.random.default_rng(1).permutation(len(held_chunks))[:2000]]
    print(f"{len(train_files)} training files ({sum(len(c) - 1 for c in train_chunks)} tokens), "
          f"{len(held_files)} held out ({sum(len(c) - 1 for c in held_chunks)} tokens)")

    net = language.build(VOCAB)
    net.assets = {"vocabulary": tok.vocabulary, "tokenizer": "lamina.text.PythonTokenizer"}
    opt = lm.optim.Adam(net, lr=2e-3, clip_norm=5.0,
                        schedule=lm.optim.CosineWarmup(min(100, args.steps // 2), args.steps, min_factor=0.05))
    start = time.perf_counter()
    data = Samples(len(train_chunks), lambda index, rng: language.training_feeds(
        net, [train_chunks[i] for i in index], NEGATIVES, rng))  # fresh sampled negatives per batch
    losses = fit(net, data, opt, epochs=100, batch_size=BATCH, max_steps=args.steps)
    step = len(losses)
    minutes = (time.perf_counter() - start) / 60
    ppl = language.perplexity(net, held_eval)
    print(f"{step} steps in {minutes:.1f} min; held-out perplexity {ppl:.2f} "
          f"({sum(len(c) - 1 for c in held_eval)} tokens, full softmax)")
    net.assets.update(held_out_perplexity=ppl, training_steps=step, training_minutes=round(minutes, 1))
    lm.save(net, args.out, half=True)
    write_metrics(HERE, args.out, losses, steps=step, minutes=round(minutes, 1), held_out_perplexity=round(ppl, 3),
                  held_out_tokens=int(sum(len(c) - 1 for c in held_eval)), vocabulary=VOCAB,
                  train_files=len(train_files), held_out_files=len(held_files))


if __name__ == "__main__":
    main()
