"""Sending one push's payload on a DEALER, zero-copy from its snapshot (the TX thread's).

A push of one chunk travels *whole* (its header and its chunk in one message); a larger one is *streamed* (its
header alone, then one tagged message per chunk). A push through shared memory carries no payload at all: its
header names the snapshot's segment (:func:`send_shared_push`).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from dpwa.node import wire
from dpwa.node.pushes import Push

__all__ = ["send_push_frames", "send_shared_push"]


def send_push_frames(sock: zmq.Socket, push: Push, header: bytes, count: Callable[[str, int], None]) -> bool:
    """Send ``push`` with ``header``, whole or streamed, every frame zero-copy from its snapshot (the frames' tracker
    goes to ``push.tracker``); counts ``pushes_sent`` and ``bytes_out``, or ``push_send_queue_full``.

    False when not even the header could be queued (nothing went out). A queue that fills after the header leaves
    the push cut short: the receiver drops it, and a SETTLE settles it."""
    snap = push.snapshot
    frames: list[zmq.Frame] = []
    started = False
    try:
        if len(snap.frames) != 1:
            sock.send(header, zmq.NOBLOCK)
            started = True
        for index, memory in enumerate(snap.frames):
            if push.prepare is not None:
                push.prepare(index)
            frame = zmq.Frame(memory, copy=False, track=True)
            first = header if len(snap.frames) == 1 else wire.encode_chunk_tag(push.seq, index)
            sock.send(first, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(frame, zmq.NOBLOCK, copy=False)
            started = True
            frames.append(frame)
        count("pushes_sent", 1)
        count("bytes_out", sum(memory.nbytes for memory in snap.frames))
        return True
    except zmq.Again:
        count("push_send_queue_full", 1)
        return started
    finally:
        if frames:
            push.tracker = zmq.MessageTracker(*frames)


def send_shared_push(sock: zmq.Socket, push: Push, header: bytes, count: Callable[[str, int], None]) -> bool:
    """Send ``push`` as ``header`` alone (it names the snapshot's segment), every chunk made ready first (a narrower
    wire dtype is rounded before the peer looks); counts ``pushes_sent`` and ``shm_pushed``, or
    ``push_send_queue_full``; False when the send queue is full."""
    if push.prepare is not None:
        push.prepare(len(push.snapshot.frames) - 1)
    try:
        sock.send(header, zmq.NOBLOCK)
    except zmq.Again:
        count("push_send_queue_full", 1)
        return False
    count("pushes_sent", 1)
    count("shm_pushed", 1)
    return True
