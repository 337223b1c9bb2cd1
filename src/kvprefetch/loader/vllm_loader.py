"""`--load-format kvprefetch`: vLLM's model loader on kvprefetch's read path and tiers.

Registered by the `vllm.general_plugins` entry point `kvprefetch_loader` (`register` below), which vLLM runs in
every engine and worker process; options come from `--model-loader-extra-config` (see `LoaderSettings`):

    vllm serve /models/llama --load-format kvprefetch \\
        --model-loader-extra-config '{"cache": {"disk": {"path": "/nvme/kvprefetch-weights"}}}'

The loader subclasses vLLM's default loader and replaces only where the weights come from: the checkpoint is
verified whole (`shards.open_checkpoint`) before any tensor is yielded, then read by `ShardReader`. vLLM's own
`model.load_weights` does the copying (and the TP slicing) and its check that every parameter was loaded, so
the parameters are exactly the default loader's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Generator

from kvprefetch.loader.cache import open_cache
from kvprefetch.loader.prefault import prefaulted
from kvprefetch.loader.reader import LoadCounters, Plan, ShardReader
from kvprefetch.loader.settings import LoaderSettings
from kvprefetch.loader.shards import open_checkpoint

log = logging.getLogger(__name__)

LOAD_FORMAT = "kvprefetch"


def register() -> None:
    """The vLLM general plugin: make `--load-format kvprefetch` known (cheap; safe to run many times)."""
    try:
        from vllm.model_executor.model_loader import register_model_loader

        register_model_loader(LOAD_FORMAT)(_loader_class())
    except Exception as err:  # vLLM runs every general plugin in every process: ours must never break one
        log.warning("kvprefetch: could not register --load-format %s with vLLM: %s", LOAD_FORMAT, err)


_CLASS = None


def _loader_class():
    """Built on first use, so that importing this module does not import vLLM."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from kvprefetch.loader.tp_ranges import ByteReads, RangePlanner

    class KVPrefetchModelLoader(DefaultModelLoader):
        """vLLM's default loader with the weights read by kvprefetch (see the module docstring)."""

        def __init__(self, load_config):
            self.settings = LoaderSettings.from_extra_config(load_config.model_loader_extra_config)
            # The default loader rejects extra-config keys it does not know: hand it none, keep ours above.
            super().__init__(dataclasses.replace(load_config, model_loader_extra_config={}))
            self.load_config = load_config
            self.last_load: LoadCounters | None = None
            self.plan: Plan | None = None
            self.reader: ShardReader | None = None  # the load in progress (for the TP guard)
            self._planner: RangePlanner | None = None

        def load_weights(self, model, model_config) -> None:
            self.plan = self._plan_ranges(model, model_config)
            guard = ByteReads(self._ensure) if self.plan is not None else contextlib.nullcontext()
            with prefaulted(list(model.parameters()) + list(model.buffers())), guard:
                super().load_weights(model, model_config)

        def _plan_ranges(self, model, model_config) -> Plan | None:
            """With TP > 1: the blocks this rank's weights come from, found by a dry run (see tp_ranges)."""
            from vllm.distributed import get_tensor_model_parallel_world_size

            if not self.settings.tp_ranges or get_tensor_model_parallel_world_size() <= 1:
                return None
            self._planner = RangePlanner(int(self.settings.block_bytes))
            try:
                with ByteReads(self._planner.on_read, skip_copies=True):
                    model.load_weights(self.get_all_weights(model_config, model))
                return self._planner.plan()
            except Exception as err:  # a weight loader that cannot run on stand-ins: read everything
                log.warning("kvprefetch loader: no per-rank byte ranges (dry run failed: %s); reading whole shards",
                            err)  # fmt: skip
                return None
            finally:
                self._planner = None
                self.counter_before_loading_weights = 0.0

        def _ensure(self, lo: int, hi: int) -> bool:
            reader = self.reader
            return reader is not None and reader.ensure(lo, hi)

        def download_model(self, model_config) -> None:
            open_checkpoint(model_config.model)  # local directories only: verify now, fail early

        def _get_weights_iterator(self, source) -> Generator[tuple[str, object], None, None]:
            directory = source.model_or_path
            if source.subfolder is not None:
                directory = f"{directory}/{source.subfolder}"
            if self._planner is not None:  # the dry run
                for name, tensor in self._planner.weights(directory):
                    yield source.prefix + name, tensor
                return
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            for name, tensor in iterate_weights(directory, self.settings, self, self.plan):
                yield source.prefix + name, tensor

    _CLASS = KVPrefetchModelLoader
    return _CLASS


def iterate_weights(directory, settings: LoaderSettings, owner=None, plan: Plan | None = None
                    ) -> Generator[tuple[str, object], None, None]:  # fmt: skip
    """Every (name, tensor) of the checkpoint, verified first, read by ShardReader, cached if configured.

    With `owner`, its `last_load` gets this load's counters (bytes from the source and from the cache), and its
    `reader` is the reader while the load runs. With `plan`, only the planned blocks are read up front.
    """
    checkpoint = open_checkpoint(directory)
    cache = open_cache(settings)
    reader = ShardReader(settings, cache, plan)
    if owner is not None:
        owner.reader = reader
    t0 = time.perf_counter()
    try:
        yield from reader.tensors(checkpoint)
        failed = reader.wait_cache()
        c = reader.counters.as_dict()
        log.info("kvprefetch loader: %s: %.2f GB in %.2f s (source %.2f GB, cache %.2f GB, cache writes %s)",
                 directory, checkpoint.total_bytes / 1e9, time.perf_counter() - t0, c["source_bytes"] / 1e9,
                 c["cache_bytes"] / 1e9, "failed" if failed else "ok")  # fmt: skip
        if owner is not None:
            owner.last_load = reader.counters
    finally:
        if owner is not None:
            owner.reader = None
        reader.close()
        if cache is not None:
            cache.close()
