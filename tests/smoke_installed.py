"""The smoke test of an installed lamina (run by `make wheel-check` with a fresh virtual
environment's python, from a folder outside the repository): import, load a shipped model and
infer, the command line, and one request through `lamina serve` with the package's own Client.

    python tests/smoke_installed.py MODELS_FOLDER
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import lamina as lm


def main(models):
    here = Path(lm.__file__).resolve()
    assert "site-packages" in str(here), f"lamina imported from {here}, not from the installed package"
    denoiser = Path(models) / "denoise3d" / "model.lamina"
    net = lm.load(denoiser)
    noisy = np.random.default_rng(0).standard_normal((2, 1, 24, 24, 24)).astype(np.float32)
    want = net.run({"noisy": noisy})["denoised"]
    assert want.shape == noisy.shape and np.isfinite(want).all()
    for provider in lm.backends.cpu.blas.available():  # each GEMM provider's library loads from its wheel
        out = subprocess.run([sys.executable, "-c", "import lamina as lm, numpy as np, sys; "
                              f"print(float(lm.load({str(denoiser)!r})(np.ones((1, 1, 24, 24, 24), np.float32)).sum()))"],
                             capture_output=True, text=True, env={**os.environ, "LAMINA_BLAS": provider})
        assert out.returncode == 0, out.stderr
    version = subprocess.run([sys.executable, "-m", "lamina.cli", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"lamina {lm.__version__}", version
    server = subprocess.Popen([sys.executable, "-m", "lamina.cli", "serve", str(denoiser), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", server.stdout.readline()).group(0)
        from lamina.serve import Client
        with Client(url) as client:
            got = client.infer("denoise3d", {"noisy": noisy}, outputs=["denoised"])["denoised"]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    finally:
        server.terminate()
        assert server.wait(30) == 0, server.stderr.read()
    print(f"installed lamina {lm.__version__} from {here.parent}: import, load, infer, CLI and serve work")


if __name__ == "__main__":
    main(sys.argv[1])
