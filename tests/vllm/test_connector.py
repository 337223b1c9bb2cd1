"""`connector.py`: what the connector refuses at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_pipeline_parallelism_is_refused_by_name():
    from kvprefetch.vllm.connector import check_parallelism

    check_parallelism(SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=8))
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        check_parallelism(SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))
