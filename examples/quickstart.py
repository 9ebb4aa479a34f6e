"""Append a few events to a thread on the embedded default store and read them back."""

from __future__ import annotations

import sys

import anyio

import eventstore as es


async def main() -> None:
    async with await es.connect() as store:
        thread = "quickstart-" + es.new_ulid()
        turn = es.new_ulid()
        await store.append(
            thread,
            [
                es.TurnOpened(turn_id=turn),
                es.MessageAppended(
                    message=es.Message(role="user", content="What is event sourcing?"),
                    turn_id=turn,
                ),
            ],
            expected_version=es.NO_THREAD,
        )
        await store.append(
            thread,
            [
                es.MessageAppended(
                    message=es.Message(role="assistant", content="Storing changes as events."),
                    turn_id=turn,
                ),
                es.TurnSettled(turn_id=turn, outcome="completed", steps=1, model_tier="small"),
            ],
            expected_version=2,
        )
        backend = type(store).__name__
        print(f"thread {thread} on {backend} (namespace {store.namespace!r})")
        async for event in store.read(thread):
            payload = event.payload
            detail = ""
            if isinstance(payload, es.MessageAppended):
                detail = f"{payload.message.role}: {payload.message.text}"
            elif isinstance(payload, es.TurnSettled):
                detail = f"turn {payload.turn_id} {payload.outcome}"
            elif isinstance(payload, es.TurnOpened):
                detail = f"turn {payload.turn_id} opened"
            print(f"  #{event.seq} {event.time:%H:%M:%S} {event.type:<18} {detail}")
        print(f"version {await store.version(thread)}")


if __name__ == "__main__":
    try:
        anyio.run(main)
    except es.EventStoreError as exc:
        print(f"threadlog: {exc}", file=sys.stderr)
        sys.exit(2)
