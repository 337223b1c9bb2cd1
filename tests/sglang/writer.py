"""A writer process for the SGLang backend's multi-process tests: stores pages `start..stop` (content a function of
the key, as in SGLang) through the zero-copy path, in batches, in the given order; prints `started` first and
`done` last. `python -m tests.sglang.writer ROOT POOL START STOP [--reverse] [--loop]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvprefetch.sglang.host_pages import PageGeometry
from kvprefetch.sglang.hostpool import host_pool
from tests.sglang.conftest import open_backend, page_content, tiers_extra

BATCH = 8


def page_key(i: int) -> str:
    return f"{i:064x}"


def main(argv: list[str]) -> None:
    root, pool_name, start, stop = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    order = list(range(start, stop))[:: -1 if "--reverse" in argv else 1]
    extra = tiers_extra(root, pool_name) | json.loads(next((a[8:] for a in argv if a.startswith("--extra=")), "{}"))
    pool = host_pool()
    backend = open_backend(extra, pool)
    n = PageGeometry.of(pool).page_bytes
    idx = pool.alloc(BATCH * pool.page_size)
    print("started", flush=True)
    for at in range(0, len(order), BATCH):
        keys = [page_key(i) for i in order[at : at + BATCH]]
        for j, key in enumerate(keys):
            pool.set_from_flat_data_page(int(idx[j * pool.page_size]), page_content(key, n))
        ok = backend.batch_set_v1(keys, idx[: len(keys) * pool.page_size])
        assert all(ok), ok
    backend.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
