"""The README's Python examples run as a user pastes them: each ```python block as a script of its own, from a
directory beside ../shared, with no `if __name__ == "__main__":` guard and with the encoder workers on."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED

REPO = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2 and "mixq.convert(" in BLOCKS[0]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_pasted(index, tmp_path):
    if not (SHARED / "models" / "glm5next-mini").is_dir():
        pytest.skip(f"shared fixtures missing: {SHARED}")
    (tmp_path / "shared").symlink_to(SHARED.resolve(), target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    script = work / "example.py"
    script.write_text(BLOCKS[index], encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=work, timeout=1100)
    assert r.returncode == 0, r.stderr[-3000:]
