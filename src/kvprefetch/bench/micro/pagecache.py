"""The kernel's page cache, dropped between a benchmark's passes so each reads the device, not RAM (root only)."""

from __future__ import annotations

import os
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> bool:
    """Write back dirty pages and drop clean ones; False where this process may not (not root)."""
    try:
        os.sync()
        DROP_CACHES.write_text("3")
        return True
    except OSError:
        return False
