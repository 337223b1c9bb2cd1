"""The I/O engine: every move between tiers, by priority class, with per-tier and per-class accounting."""

from kvprefetch.io.engine import IOClass, IOEngine, IOTicket
from kvprefetch.io.throttle import RateLimiter

__all__ = ["IOClass", "IOEngine", "IOTicket", "RateLimiter"]
