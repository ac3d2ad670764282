"""Every Python snippet of the README runs as written, each on its own (its own imports, no
undefined names), in a fresh interpreter whose working folder has the shipped models."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path):
    (tmp_path / "models").symlink_to(ROOT / "models")
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPETS[index])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "LAMINA_THREADS": "2"})
    assert proc.returncode == 0, f"README snippet {index}:\n{SNIPPETS[index]}\n{proc.stderr[-3000:]}"
