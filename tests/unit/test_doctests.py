"""Every docstring example in ``ftrain`` runs and shows what is true (the doctests pass)."""

import doctest
import importlib
import io
import pkgutil
import random
import tempfile

import pytest
import torch

import ftrain

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Entry points (importing runs them) and the fault-injection hook Python imports at startup.
NOT_IMPORTABLE = {"__main__", "sitecustomize"}


def _modules() -> list[str]:
    # ``onerror``: a package whose import needs a missing extra is still listed (its test
    # skips); only its submodules are not walked.
    walk = pkgutil.walk_packages(ftrain.__path__, "ftrain.", onerror=lambda name: None)
    names = [m.name for m in walk if m.name.rsplit(".", 1)[-1] not in NOT_IMPORTABLE]
    return ["ftrain", *sorted(names)]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, tmp_path, tmp_path_factory, monkeypatch):
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        if (e.name or "").split(".")[0] == "ftrain":
            raise  # a broken import inside ftrain, not a missing optional extra
        pytest.skip(f"{name} needs an optional extra that is not installed: {e}")
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    # examples make their directories with tempfile.mkdtemp(): under pytest's tmp, not /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("mkdtemp")))
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out = io.StringIO()
    with _global_rngs_kept():  # hostrng's example seeds them: later tests see them as before
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
            runner.run(test, out=out.write)
    assert runner.failures == 0, (
        f"{runner.failures} failing example(s) in {name}:\n{out.getvalue()}"
    )
    written = sorted(p.name for p in tmp_path.iterdir())
    assert not written, f"examples in {name} wrote {written} into the working directory"


class _global_rngs_kept:
    def __enter__(self):
        np = _numpy()
        self.saved = (random.getstate(), torch.get_rng_state(), np and np.random.get_state())
        return self

    def __exit__(self, *exc):
        random.setstate(self.saved[0])
        torch.set_rng_state(self.saved[1])
        if self.saved[2] is not None:
            _numpy().random.set_state(self.saved[2])


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy
