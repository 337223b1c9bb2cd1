"""The scenarios of `kvprefetch bench`, each one module behind one contract (`base.Scenario`), by kind.

The runner asks each, in this order, what it runs of the run (`plan`), and runs those that answer: the single
scenario's cells come before the two-instance modes', as they always have (both may run in one run). A new
scenario is a module here and its line below (and, if it has options of its own, a kind in
`kvprefetch.bench.options.ScenarioOptions`).
"""

from __future__ import annotations

from kvprefetch.bench.scenarios.base import Scenario, Sections, Stage
from kvprefetch.bench.scenarios.cluster_serve import ClusterServe
from kvprefetch.bench.scenarios.single import Single
from kvprefetch.bench.scenarios.two_instance import TwoInstance
from kvprefetch.bench.scenarios.two_node import TwoNode

SCENARIOS: dict[str, Scenario] = {
    Single.kind: Single(),
    TwoInstance.kind: TwoInstance(),
    TwoNode.kind: TwoNode(),
    ClusterServe.kind: ClusterServe(),
}

__all__ = ["SCENARIOS", "Scenario", "Sections", "Stage"]
