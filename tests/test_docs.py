"""The commands the READMEs and the user scripts' docstrings give name files that exist."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "kernels/README.md", *sorted(str(p.relative_to(REPO)) for d in ("scripts", "benchmarks")
                                           for p in (REPO / d).iterdir() if p.suffix in (".py", ".sh"))]
PATH = re.compile(r"(?<![\w/.])((?:scripts|benchmarks|kernels|tests|cute_deform|docs|\.ci)/[\w./-]+\.(?:py|sh|cu|cuh|cpp|h|md))")


@pytest.mark.parametrize("doc", DOCS)
def test_named_files_exist(doc):
    named = set(PATH.findall((REPO / doc).read_text()))
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_the_readme_names_the_user_scripts():
    named = set(PATH.findall((REPO / "README.md").read_text()))
    assert {"scripts/compare.py", "scripts/tune.py", "scripts/gpu_all.sh", "scripts/precompile.py"} <= named
