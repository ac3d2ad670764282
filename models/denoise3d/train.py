"""Trains models/denoise3d/model.lamina: a volumetric denoiser (Conv3d encoder, ConvTranspose3d
decoder, residual output) on synthetic noisy 3-D shapes.

Data: 24³ volumes of random balls, boxes and ellipsoids (lamina.zoo.denoise.shapes), Gaussian
noise sigma 0.25 drawn fresh for every batch; 512 training volumes (seed 0) and 32 held-out
volumes (seed 1, noise seed 2). Adam 2e-3, cosine decay, batches of 8.

    .venv/bin/python models/denoise3d/train.py [--minutes 5] [--out models/denoise3d/model.lamina]
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import lamina as lm
from lamina.zoo import denoise

HERE = Path(__file__).resolve().parent
BATCH, TRAIN, HELD = 8, 512, 32


def held_out():
    clean = denoise.shapes(HELD, np.random.default_rng(1))
    return denoise.noisy_copy(clean, np.random.default_rng(2)), clean


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--out", default=str(HERE / "model.lamina"))
    args = parser.parse_args()
    lm.manual_seed(0)
    rng = np.random.default_rng(0)
    train = denoise.shapes(TRAIN, rng)
    test_noisy, test_clean = held_out()
    net = denoise.build()
    net.assets = {"noise_sigma": denoise.NOISE, "size": denoise.SIZE}
    opt = lm.optim.Adam(net, lr=2e-3, schedule=lm.optim.CosineWarmup(min(50, args.steps // 2), args.steps, min_factor=0.02))
    start, losses = time.perf_counter(), []
    bar = tqdm(total=args.steps, unit="step", mininterval=2)
    for step in range(args.steps):
        if time.perf_counter() - start > args.minutes * 60:
            break
        clean = train[rng.integers(0, TRAIN, BATCH)]
        losses.append(net.train_step({"noisy": denoise.noisy_copy(clean, rng), "clean": clean}, opt))
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.2f}")
    bar.close()
    minutes = (time.perf_counter() - start) / 60
    out = net.run({"noisy": test_noisy}, ["denoised"])["denoised"]
    before, after = denoise.psnr(test_noisy, test_clean), denoise.psnr(out, test_clean)
    print(f"{len(losses)} steps in {minutes:.1f} min; held-out PSNR {before:.2f} dB noisy -> {after:.2f} dB denoised")
    net.assets.update(psnr_noisy=before, psnr_denoised=after)
    lm.save(net, args.out, half=True)
    denoise.save_slices_png(HERE / "slices.png", test_noisy[:3], out[:3], test_clean[:3],
                            f"held out: {before:.1f} dB -> {after:.1f} dB")
    (HERE / "metrics.json").write_text(json.dumps({
        "steps": len(losses), "minutes": round(minutes, 1), "psnr_noisy_db": round(before, 2),
        "psnr_denoised_db": round(after, 2), "held_out_volumes": HELD,
        "size_bytes": os.path.getsize(args.out)}, indent=1) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e3:.0f} kB) and {HERE / 'slices.png'}")


if __name__ == "__main__":
    main()
