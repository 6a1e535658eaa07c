"""Options of the chaos suite: kill count (CI or long mode) and seed; the end-of-run report.

CI mode (default): 12 kills (8 on 1 rank, 4 on 2 ranks). Long mode:
``python -m pytest tests/chaos --chaos-long`` (100 kills), or any count with
``FTRAIN_CHAOS_KILLS=N``. Replay a plan with ``--chaos-seed=N`` or ``FTRAIN_CHAOS_SEED=N``;
without one each session draws a fresh seed, printed in the report and in every failure.
"""

import os
import secrets

import pytest

from tests.integration.conftest import cache_dir  # noqa: F401 - the shared fixture

CI_KILLS = 12
LONG_KILLS = 100
# The key of a report line in a test's ``user_properties``: they travel with the test's
# reports, so the summary sees them also when the tests ran in pytest-xdist workers.
_REPORT_KEY = "chaos"


def pytest_addoption(parser):
    group = parser.getgroup("chaos", "ftrain chaos suite (tests/chaos)")
    group.addoption(
        "--chaos-long",
        action="store_true",
        default=False,
        help=f"long chaos mode: {LONG_KILLS} SIGKILLs instead of {CI_KILLS}",
    )
    group.addoption("--chaos-kills", type=int, default=None, help="total SIGKILLs (overrides)")
    group.addoption("--chaos-seed", type=int, default=None, help="replay the plan of this seed")


def _option(config, name):
    try:
        return config.getoption(name)
    except ValueError:  # this conftest was not loaded at start-up: no such option
        return None


@pytest.fixture(scope="session")
def chaos_kills(pytestconfig) -> int:
    """Total kills over the 1-rank and 2-rank drills."""
    if _option(pytestconfig, "--chaos-kills"):
        return _option(pytestconfig, "--chaos-kills")
    if os.environ.get("FTRAIN_CHAOS_KILLS"):
        return int(os.environ["FTRAIN_CHAOS_KILLS"])
    return LONG_KILLS if _option(pytestconfig, "--chaos-long") else CI_KILLS


@pytest.fixture(scope="session")
def chaos_seed(pytestconfig) -> int:
    seed = _option(pytestconfig, "--chaos-seed")
    if seed is None and os.environ.get("FTRAIN_CHAOS_SEED"):
        seed = int(os.environ["FTRAIN_CHAOS_SEED"])
    return seed if seed is not None else secrets.randbelow(2**31)


@pytest.fixture
def chaos_report(request):
    """``add(line)``: a line for the terminal summary (shown whether the test passed or not)."""
    return lambda line: request.node.user_properties.append((_REPORT_KEY, line))


def _report_lines(terminalreporter) -> list[str]:
    """Each test's lines once: from its teardown report, which carries all of them."""
    return [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "teardown"
        for key, value in getattr(report, "user_properties", ())
        if key == _REPORT_KEY
    ]


def pytest_terminal_summary(terminalreporter):
    lines = _report_lines(terminalreporter)
    if lines:
        terminalreporter.section("chaos")
        for line in lines:
            terminalreporter.write_line(line)
