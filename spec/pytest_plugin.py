"""pytest plugin (entry point ``pytest11: ioprep``): the catalogue in an engine's own test session.

``pytest --ioprep-engine mypkg.mod:make_engine`` adds one test per invariant x mode x device
(``ioprep::INV-MASK-001-<engine>-padded-cpu``), run by :func:`spec.run.runner.run_invariant` exactly as
``python -m spec verify`` runs them: skipped with the reason where the engine lacks a feature, xfailed
for its known failures, failed with the minimal counterexample. A layout-profile invariant
(``InvariantInfo.layout``) that does not pass is xfailed, never failed: as in ``spec verify``, it is
reported and kept out of the verdict (the session fails exactly when ``spec verify`` would). ``--ioprep-profile`` picks the
hypothesis profile, ``--ioprep-only`` an ID prefix, ``--ioprep-device`` the devices,
``--ioprep-report DIR`` writes the Markdown and JSON report, one per engine (``--ioprep-engine`` repeated: each
report titled with its own engine and holding only its results). An unknown engine, planted bug, profile or
``--ioprep-only`` prefix is a pytest usage error (one line with "did you mean", exit code 4), not an internal error.

The targets that share a case stream (spec/run/groups.py) run as one group, as in ``spec verify``: the first of
them a process runs checks the whole group (one draw, one engine run per shaped case) and the others read their
outcomes from it. Each item carries ``xdist_group`` with its stream, so ``--dist loadgroup`` sends a group to one
worker; under another distribution a worker that gets an item of a group runs that group once.
Under pytest-xdist (``-n auto``) each invariant x mode x device is one test, distributed per test like any
other; every outcome travels to the controller on its test report (``user_properties``), which writes the
summary line and the one report, in catalogue order, as a run without xdist does.

Without ``--ioprep-engine`` the plugin adds nothing and imports nothing of the suite: it is loaded by
every pytest session of an environment where this package is installed, so the suite (torch,
hypothesis, the engines) is imported inside :func:`_suite` only when asked for. That is the one
function-local import here, on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

__all__ = ["IoprepItem"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ioprep", "engine input/output preparation conformance (rl-ioprep)")
    group.addoption("--ioprep-engine", action="append", default=None,
                    help="engine under test: a registered name (python -m spec engines) or module:attr; repeatable")
    group.addoption("--ioprep-profile", default=None, help="hypothesis profile: default, dev, ci, pr, thorough, cuda, debug")
    group.addoption("--ioprep-device", action="append", default=None, choices=("cpu", "cuda"),
                    help="devices (default: cpu)")
    group.addoption("--ioprep-only", default=None,
                    help="only invariant IDs starting with one of these comma-separated prefixes")
    group.addoption("--ioprep-report", default=None, help="folder for the conformance report (Markdown and JSON)")


def _suite() -> Any:
    import spec.run.registry
    import spec.run.profiles
    import spec.run.parallel
    import spec.report
    import spec.run.runner

    return spec


class IoprepItem(pytest.Item):
    """One invariant x mode x device against one engine."""

    def __init__(self, *, info: Any, engine: Any, mode: str, device: str, order: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.info, self.engine, self.mode, self.device = info, engine, mode, device
        self.order = order  # its place in the catalogue, for the report
        self.outcome = None
        #: the collected targets that share its case stream (itself included), run as one group
        self.members: list[tuple[Any, str]] = [(info, mode)]

    def _run(self, suite: Any) -> Any:
        """Its outcome: from its group's run (once per process), or its own run where it shares no stream."""
        stream = self.info.stream(self.mode)
        if stream is None or len(self.members) == 1:
            return suite.run.runner.run_invariant(self.info, self.engine, self.mode, self.device)
        key = (id(self.engine), self.device, stream)
        if key not in _GROUPS:
            outcomes = suite.run.runner.run_group(self.members, self.engine, self.device)
            _GROUPS[key] = {(o.invariant, o.mode): o for o in outcomes}
        return _GROUPS[key][(self.info.id, self.mode)]

    def runtest(self) -> None:
        suite = _suite()
        reason = self.engine.implied_needs(tuple(self.info.needs))
        if reason:
            self.outcome = suite.run.runner.Outcome(self.info.id, self.engine.name, self.mode, self.device, "skip",
                                                reason=reason, layout=self.info.layout)
        else:
            self.outcome = self._run(suite)
        # read back by pytest_runtest_logreport, here or (under xdist) in the controller
        self.user_properties.append((_PROPERTY, {"order": self.order, "outcome": self.outcome.as_dict()}))
        o = self.outcome
        if o.status == "skip":
            pytest.skip(o.reason)
        if o.status == "unexercised":  # examples ran, none exercised the property: never a pass
            pytest.skip(o.reason)
        if o.layout and o.status != "pass":  # the layout profile: reported, never part of the verdict
            pytest.xfail(f"layout profile (not part of the verdict): {o.invariant} {o.status} on {o.engine}: "
                         f"{o.counterexample or ''} {o.error or o.reason or ''}".rstrip())
        if o.status == "xfail":
            pytest.xfail(f"known failure of {o.engine}: {o.reason} | {o.counterexample} -> {o.error}")
        if o.status == "xpass":
            pytest.fail(f"{o.invariant} is a known failure of {o.engine} ({o.reason}) but passed", pytrace=False)
        if o.status == "fail":
            pytest.fail(f"{o.invariant} ({self.info.title}) fails on {o.engine} [{o.mode}, {o.device}]\n"
                        f"minimal counterexample: {o.counterexample}\n{o.error}", pytrace=False)
        if o.status == "error":
            pytest.fail(f"{o.invariant} on {o.engine} [{o.mode}, {o.device}]: {o.error}", pytrace=False)

    def reportinfo(self):
        return self.path, None, f"ioprep::{self.name}"


_OUTCOMES = pytest.StashKey[list]()
#: per process: (engine, device, stream) -> its group's outcomes by (invariant, mode)
_GROUPS: dict[tuple, dict] = {}
_PROPERTY = "ioprep_outcome"


class _Outcomes:
    """Collects each ioprep test's outcome from its report (under xdist: the controller's copy)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for name, value in getattr(report, "user_properties", ()):
            if name == _PROPERTY:
                self.config.stash.setdefault(_OUTCOMES, []).append((value["order"], value["outcome"]))


def _usage_errors(suite: Any, call: Any, *args: Any) -> Any:
    """``call(*args)``, a name that names nothing (``spec.run.registry.UnknownName``) as a pytest usage error."""
    try:
        return call(*args)
    except suite.run.registry.UnknownName as exc:
        raise pytest.UsageError(f"ioprep: {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("ioprep_engine"):
        config.pluginmanager.register(_Outcomes(config), "ioprep-outcomes")
        suite = _suite()
        _usage_errors(suite, suite.run.registry.checked_profile, config.getoption("ioprep_profile"))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    names = config.getoption("ioprep_engine")
    if not names:
        return
    suite = _suite()
    prefixes = tuple((config.getoption("ioprep_only") or "").split(","))
    _usage_errors(suite, suite.run.registry.check_prefixes, [p for p in prefixes if p],
                  [info.id for info, _ in suite.run.runner.instances()])
    devices = config.getoption("ioprep_device") or ["cpu"]
    order = 0
    streams: dict[tuple, list] = {}  # (engine, device, stream) -> its items
    for name in names:
        engine = _usage_errors(suite, suite.run.registry.load_engine, name)
        for info, mode in suite.run.runner.instances():
            if not info.id.startswith(prefixes):
                continue
            for device in devices:
                item = IoprepItem.from_parent(session, name=f"{info.id}-{engine.name}-{mode}-{device}",
                                              info=info, engine=engine, mode=mode, device=device, order=order)
                stream = info.stream(mode)
                if stream is not None:
                    item.add_marker(pytest.mark.xdist_group(f"{engine.name}-{device}-{stream}"))
                    streams.setdefault((id(engine), device, stream), []).append(item)
                items.append(item)
                order += 1
    for members in streams.values():
        for item in members:
            item.members = [(m.info, m.mode) for m in members]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    collected = config.stash.get(_OUTCOMES, [])
    if not collected:
        return
    suite = _suite()
    report = suite.report
    outcomes = [suite.run.parallel.outcome_from_dict(o) for _, o in sorted(collected, key=lambda item: item[0])]
    folder = config.getoption("ioprep_report")
    by_engine: dict[str, list] = {}
    for o in outcomes:  # each engine's own outcomes, in catalogue order
        by_engine.setdefault(o.engine, []).append(o)
    for engine, mine in by_engine.items():
        terminalreporter.write_line(f"ioprep: {engine}: {report.summary_line(mine)}" if len(by_engine) > 1
                                    else f"ioprep: {report.summary_line(mine)}")
        if folder:
            profile = config.getoption("ioprep_profile") or "default"
            paths = report.write_reports(mine, Path(folder) / f"verify-{report.safe_name(engine)}", engine=engine,
                                         profile=profile, device=",".join(sorted({o.device for o in mine})))
            terminalreporter.write_line("ioprep report: " + ", ".join(str(p) for p in paths))
