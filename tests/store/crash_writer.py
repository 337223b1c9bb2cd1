"""Child process for the crash test: puts chunks forever, printing each key once it is durable."""

import sys

import numpy as np

from kvprefetch.config import StoreConfig
from kvprefetch.store import TieredStore

CHUNK = 64 * 1024


def payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, CHUNK, dtype=np.uint8)


def main(disk: str, pool: str, seed: int) -> None:
    cfg = StoreConfig.load(dram={"capacity_bytes": 2 << 20, "pool_name": pool}, disk={"path": disk})
    store = TieredStore(cfg, chunk_bytes=CHUNK)
    rng = np.random.default_rng(seed)
    while True:
        keys = [rng.bytes(32) for _ in range(int(rng.integers(1, 4)))]
        store.put(keys, [payload(k) for k in keys]).result()
        sys.stdout.write("".join(f"ACK {k.hex()}\n" for k in keys))  # one write per acknowledgement batch
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
