"""`kvprefetch events`: what a KV-aware router hears from an engine's KV events, live: blocks per tier (medium,
locality, ownership), stores and removals per second. The tool to reach for when a router misroutes: it shows
whether the engine announces its blocks at all, in which tiers, and whether removals follow evictions.

It subscribes to vLLM's publisher (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``) and decodes with vLLM's own event classes, so what it counts is what any
router built on them sees. (Batches published before it connected are not seen: ZMQ's PUB/SUB keeps none.)
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

console = Console()

Where = tuple[str, str, str]  # (medium, locality, ownership), "-" where an event leaves one out


def where_of(event: Any) -> Where:
    return (event.medium or "-", getattr(event, "locality", None) or "-", getattr(event, "ownership", None) or "-")


@dataclass
class EventIndex:
    """A router's index, from the events alone: the block hashes each tier holds, and what changed."""

    blocks: dict[Where, set] = field(default_factory=lambda: defaultdict(set))
    stored: Counter = field(default_factory=Counter)  # blocks announced stored, per tier
    removed: Counter = field(default_factory=Counter)
    batches: int = 0
    cleared: int = 0  # AllBlocksCleared events (the engine's prefix cache reset)

    def apply(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        self.batches += 1
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.blocks[where_of(e)].update(e.block_hashes)
                self.stored[where_of(e)] += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks[where_of(e)].difference_update(e.block_hashes)
                self.removed[where_of(e)] += len(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.cleared += 1
                for w in self.blocks:
                    if w[0] == "GPU":
                        self.blocks[w].clear()

    def summary(self, seconds: float) -> dict[str, Any]:
        tiers = sorted(set(self.blocks) | set(self.stored) | set(self.removed))
        per_s = max(seconds, 1e-9)
        return {
            "seconds": round(seconds, 1), "batches": self.batches, "all_cleared": self.cleared,
            "tiers": [{"medium": m, "locality": loc, "ownership": own, "blocks": len(self.blocks[(m, loc, own)]),
                       "stored": self.stored[(m, loc, own)], "removed": self.removed[(m, loc, own)],
                       "stored_per_s": round(self.stored[(m, loc, own)] / per_s, 1),
                       "removed_per_s": round(self.removed[(m, loc, own)] / per_s, 1)}
                      for m, loc, own in tiers],
        }  # fmt: skip


def _table(url: str, s: dict[str, Any]) -> Table:
    t = Table(title=f"KV events from {url}: {s['batches']} batches in {s['seconds']} s")
    for col in ("medium", "locality", "ownership", "blocks", "stored/s", "removed/s", "stored", "removed"):
        t.add_column(col, justify="right" if col not in ("medium", "locality", "ownership") else "left")
    for r in s["tiers"]:
        t.add_row(r["medium"], r["locality"], r["ownership"], str(r["blocks"]), f"{r['stored_per_s']:.1f}",
                  f"{r['removed_per_s']:.1f}", str(r["stored"]), str(r["removed"]))  # fmt: skip
    return t


def events(
    url: Annotated[str, typer.Option("--url", help="The engine's publisher, e.g. tcp://HOST:5557.")],
    topic: Annotated[str, typer.Option("--topic", help="The publisher's topic (KVEventsConfig.topic).")] = "",
    seconds: Annotated[float, typer.Option("--seconds", min=0, help="Stop after this long (0: at Ctrl-C).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON summary at the end.")] = False,
) -> None:
    """Subscribe to an engine's KV events and show what a router sees: blocks per tier, stores/removals per second."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    if not url.startswith(("tcp://", "ipc://")) or url.startswith("tcp://*"):
        console.print(f"[red]--url takes the address to connect to (tcp://HOST:PORT or ipc://PATH), got {url}[/red]")
        raise typer.Exit(2)
    # Ctrl-C ends it, also where SIGINT came ignored (a job a non-interactive shell put in the background)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(url)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    decoder, index, t0 = msgspec.msgpack.Decoder(type=KVEventBatch), EventIndex(), time.monotonic()
    Console(stderr=True).print(f"kvprefetch events: subscribed to {url}" + (f" (topic {topic!r})" if topic else ""))
    bad = 0
    live = None if as_json else Live(_table(url, index.summary(0)), console=console, refresh_per_second=2)
    try:
        if live is not None:
            live.start()
        while not seconds or time.monotonic() - t0 < seconds:
            if sock.poll(250):
                frames = sock.recv_multipart()
                try:
                    index.apply(decoder.decode(frames[-1]))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    bad += 1  # another publisher's format on this port: counted, not fatal
            if live is not None:
                live.update(_table(url, index.summary(time.monotonic() - t0)))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        sock.close(linger=0)
    summary = index.summary(time.monotonic() - t0) | {"undecodable": bad}
    if as_json:
        print(json.dumps(summary))
    elif bad:
        console.print(f"[yellow]{bad} messages were not vLLM KV event batches[/yellow]")


def register(app: typer.Typer) -> None:
    app.command("events")(events)
