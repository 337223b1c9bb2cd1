"""Micro-benchmarks: one part of the read path at a time, each next to its yardstick in the same run.

    iobench      the disk tier's cold reads and write-back against fio's ceiling (`kvprefetch iobench`)
    remotebench  the remote tier's reads against the backend's raw client (`kvprefetch remotebench`)
    loadbench    the weight loader against vLLM's loaders and fio (`kvprefetch loadbench`)
    poolbench    a new DRAM pool's ways to get its memory, side by side (`kvprefetch poolbench`)
    fio_reference  fio's read ceiling on iobench's directory; hugepages  2 MiB pages reserved for a run
    *_cli        each one's command (iobench_cli, ... poolbench_cli), registered by kvprefetch.cli

The serving benchmark (`kvprefetch bench`, the rest of kvprefetch.bench) measures whole engines under a workload;
these measure one layer each, so a change to that layer is judged on it alone.
"""
