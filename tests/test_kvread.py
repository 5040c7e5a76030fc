"""Complete reads of a KV bucket on a real nats-server, including the case nats-py gets
wrong: its "initial values done" marker arriving before the values themselves."""

from __future__ import annotations

import asyncio

import anyio

from mlscope import bus as busmod
from mlscope import names
from mlscope.kvread import BucketWatch, bucket_keys
from mlscope.loadgens import ensure_bucket as ensure_loadgens_bucket
from mlscope.loadgens import list_loadgens
from mlscope.provision import provisioned
from mlscope.registry import list_agents
from mlscope.settings import Settings

BUCKET = names.MODELS_BUCKET
N = 200


async def _fill(bus: busmod.Bus) -> None:
    kv = await bus.kv(BUCKET)
    for i in range(N):
        await kv.put(f"k{i:03d}", b"v")


def test_bucket_keys_lists_every_key_and_the_deleted_ones(settings: Settings) -> None:
    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            assert await bucket_keys(bus, BUCKET) == []
            assert await list_agents(bus) == []
            await _fill(bus)
            kv = await bus.kv(BUCKET)
            await kv.put("k000", b"again")  # one key, however many revisions
            await kv.delete("k001")
            keys = await bucket_keys(bus, BUCKET)
            assert keys == [f"k{i:03d}" for i in range(N)]  # k001 as a delete marker


def test_a_key_no_client_can_read_does_not_fail_a_listing(settings: Settings) -> None:
    """Whoever may write into a bucket's stream may publish any subject under it; such
    a key is left out, and every readable entry is still listed."""

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            await ensure_loadgens_bucket(bus)
            for bucket in (names.AGENTS_BUCKET, names.LOADGENS_BUCKET, BUCKET):
                await bus.kv(bucket)
                for key in ("bad#key", "per%cent", "t\u00e9"):
                    await bus.nc.publish(f"$KV.{bucket}.{key}", b"x")
                await (await bus.kv(bucket)).put("good", b"v")
                await bus.nc.flush()
                assert await bucket_keys(bus, bucket) == ["good"], bucket
            assert await list_agents(bus) == []  # "good" is not an agent: no error either
            assert await list_loadgens(bus) == []

    anyio.run(main, backend="asyncio")

    anyio.run(main, backend="asyncio")


def test_watch_reports_caught_up_once_after_every_initial_value(settings: Settings) -> None:
    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            async with BucketWatch(bus, BUCKET) as watch:  # empty: caught up at once
                assert await watch.__aiter__().__anext__() is None
            await _fill(bus)
            kv = await bus.kv(BUCKET)
            await kv.delete("k005")
            async with BucketWatch(bus, BUCKET) as watch:
                # nats-py's marker overtaking the values (seen on a loaded machine):
                # put it in front of everything the watcher has received so far.
                queue: asyncio.Queue[object] = asyncio.Queue()
                queue.put_nowait(None)
                while not watch._watcher._updates.empty():
                    queue.put_nowait(watch._watcher._updates.get_nowait())
                watch._watcher._updates = queue
                seen: list[str | None] = []
                async for entry in watch:
                    seen.append(None if entry is None else entry.key)
                    if entry is None:
                        await kv.put("late", b"v")
                    elif entry.key == "late":
                        break
            assert seen.index(None) == N  # all N keys (k005 as a delete) before the marker
            assert seen.count(None) == 1 and seen[-1] == "late"

    anyio.run(main, backend="asyncio")
