"""The suite's scheduling under pytest-xdist (`make test` runs it on two workers, `--dist loadgroup`).

A test file's tests share module fixtures (a server, a redis, an engine), and the connector tests under
`tests/vllm` share session engines and a disk tier across files: each such set runs on one worker, in file
order, so no fixture starts twice and no test finds another's state half made. Without xdist nothing changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
SHARED_SESSION = ("vllm",)  # folders whose files share session fixtures: one group each


def group_of(path: Path) -> str:
    rel = path.relative_to(HERE)
    return rel.parts[0] if rel.parts[0] in SHARED_SESSION else rel.as_posix()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(Path(item.path))))
