"""Every code block of the README and of the documentation (docs/) runs as written from an empty
folder: each ```python block in a fresh interpreter, each ```sh block in bash (-e, pipefail),
with the installed lamina and its command on the PATH. Blocks marked ```text are commands that
need the source folder or are shown, not run (make, pip install .): CI runs those itself. The
documentation site builds with every link and API reference resolved (mkdocs --strict)."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_OPENCL, OPENCL_DEVICES

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page, lang, code) for page in PAGES
          for lang, code in re.findall(r"```(python|sh)\n(.*?)```", page.read_text(), re.S)]


def test_the_pages_have_blocks_to_run():
    assert sum(page.name == "README.md" for page, _, _ in BLOCKS) >= 4
    assert {lang for _, lang, _ in BLOCKS} == {"python", "sh"}


@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=[f"{p.relative_to(ROOT)}-{i}" for i, (p, _, _) in enumerate(BLOCKS)])
def test_code_block_runs_from_an_empty_folder(index, tmp_path):
    page, lang, code = BLOCKS[index]
    if "opencl" in code and not OPENCL_DEVICES:
        pytest.skip(f"the block runs on an OpenCL device: {NO_OPENCL}")
    script = tmp_path / ("block.py" if lang == "python" else "block.sh")
    script.write_text(code)
    command = [sys.executable, str(script)] if lang == "python" else ["bash", "-e", "-o", "pipefail", str(script)]
    env = {**os.environ, "LAMINA_THREADS": "2", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    # its own process group: a block's background process (a server) ends with it, whatever happens
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += "\n(timed out after 300 s)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{page.relative_to(ROOT)}, block {index}:\n{code}\n{out[-2000:]}\n{err[-3000:]}"


def test_the_documentation_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("Network") > 5
