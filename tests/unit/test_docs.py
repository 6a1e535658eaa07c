"""The README and docs say what is true: their code runs, and CI runs the README's test command."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ["README.md", "docs/custom-step.md", "docs/concepts.md", "docs/fine-tuning.md"]


def _python_blocks(path: Path) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))


@pytest.mark.parametrize("doc", RUNNABLE)
def test_python_blocks_run(doc, tmp_path):
    code = _python_blocks(ROOT / doc)
    assert code, f"{doc} has no python block"
    script = tmp_path / "doc.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_readme_test_command():
    readme_lines = (ROOT / "README.md").read_text().splitlines()
    test_cmd = next(line for line in readme_lines if "pytest" in line)
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_lines[3].startswith("pip install torch==2.13.0"), (
        "README opens with the install command"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_exist():
    for link in re.findall(r"\]\((docs/[^)]+)\)", (ROOT / "README.md").read_text()):
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, link


def test_data_md_evaluation_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "data.md").read_text(), re.S)
    example = next(b for b in blocks if "ftrain.evaluate(" in b)
    script = tmp_path / "eval.py"
    script.write_text(example)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip()) > 0


def test_gpu_check_skips_cleanly_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: run benchmarks/gpu_check.py itself")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "no CUDA device is visible" in proc.stdout, proc.stderr
