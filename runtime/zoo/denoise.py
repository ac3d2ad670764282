"""A volumetric denoiser: Conv3d encoder, ConvTranspose3d decoder, predicting the noise it
removes (a residual), trained on synthetic noisy 3-D shapes. Used by models/denoise3d/train.py,
the `lamina` command and the demo.

Graph: inputs noisy [1, S, S, S] and clean [1, S, S, S]; outputs denoised (noisy minus the
predicted noise) and loss (squared error against clean, summed per volume).
Encoder: Conv3d(1->16, k3, s1, p1) ReLU, Conv3d(16->32, k3, s2, p1) ReLU; decoder:
ConvTranspose3d(32->16, k4, s2, p1) ReLU, concatenated with the first features,
Conv3d(32->1, k3, p1) = the noise.
"""
import numpy as np

from .. import layers
from ..graph import Network

SIZE = 24
NOISE = 0.25


def build(size=SIZE):
    net = Network()
    noisy = net.input("noisy", (1, size, size, size))
    clean = net.input("clean", (1, size, size, size))
    f1 = layers.Conv3d(1, 16, 3, padding=1, name="enc1")(noisy)
    f1 = layers.Activation("relu", name="relu1")(f1)
    f2 = layers.Activation("relu", name="relu2")(layers.Conv3d(16, 32, 3, stride=2, padding=1, name="enc2")(f1))
    up = layers.Activation("relu", name="relu3")(layers.ConvTranspose3d(32, 16, 4, stride=2, padding=1, name="dec1")(f2))
    noise = layers.Conv3d(32, 1, 3, padding=1, name="dec2")(layers.ConcatChannels(name="skip")(up, f1))
    denoised = layers.Add(name="residual")(noisy, layers.Scale(-1.0, name="negate")(noise))
    net.outputs(denoised=denoised, loss=layers.SquareError(name="mse")(denoised, clean))
    return net


def shapes(count, rng, size=SIZE):
    """Clean volumes in [0, 1]: each a few random balls, boxes and ellipsoids of random
    intensity, on a dark background."""
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, size)] * 3, indexing="ij"))
    out = np.zeros((count, 1, size, size, size), np.float32)
    for v in out:
        for _ in range(rng.integers(2, 5)):
            center = rng.uniform(-0.6, 0.6, 3)[:, None, None, None]
            radii = rng.uniform(0.15, 0.45, 3)[:, None, None, None]
            d = (grid - center) / radii
            kind = rng.integers(0, 3)
            if kind == 0:
                inside = (d ** 2).sum(0) <= 1  # ellipsoid
            elif kind == 1:
                inside = np.abs(d).max(0) <= 1  # box
            else:
                inside = ((grid - center) ** 2).sum(0) <= radii.min() ** 2  # ball
            v[0][inside] = rng.uniform(0.4, 1.0)
    return out


def noisy_copy(clean, rng, sigma=NOISE):
    return (clean + rng.normal(0, sigma, clean.shape)).astype(np.float32)


def psnr(estimate, clean):
    """Peak signal-to-noise ratio in dB for signals in [0, 1], per volume, averaged."""
    mse = ((estimate - clean) ** 2).reshape(len(clean), -1).mean(1)
    return float(np.mean(10 * np.log10(1.0 / mse)))


def save_slices_png(path, noisy, denoised, clean, title=""):
    """The middle depth slice of each volume: noisy, denoised, clean side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = len(clean)
    fig, axes = plt.subplots(rows, 3, figsize=(7.5, 2.5 * rows), squeeze=False)
    mid = clean.shape[2] // 2
    for r in range(rows):
        for c, (name, vol) in enumerate((("noisy", noisy), ("denoised", denoised), ("clean", clean))):
            ax = axes[r, c]
            ax.imshow(vol[r, 0, mid], cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
