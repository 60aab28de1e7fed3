"""Memory an engine hands its transfer I/O process by descriptor (transfer/private_memory.py): the same pages
on both sides, checked on receipt (whose region, how big), and no name in /dev/shm."""

from __future__ import annotations

import os
import socket

import pytest

from mooncaked.transfer import TransferError
from mooncaked.transfer.private_memory import create_private, receive_mapping, send_descriptor


def test_a_descriptor_handed_over_maps_the_same_pages() -> None:
    fd, ours = create_private(1 << 20)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        send_descriptor(a, "kv", fd)
        theirs = receive_mapping(b, "kv", 1 << 20)
        ours[:5] = b"hello"
        assert theirs[:5] == b"hello"
        theirs[-3:] = b"end"
        assert ours[-3:] == b"end"
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:mooncaked-region")
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_a_wrong_or_short_descriptor_is_refused_by_name() -> None:
    fd, _ = create_private(4096)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        send_descriptor(a, "other", fd)
        with pytest.raises(TransferError, match="expected region 'kv'"):
            receive_mapping(b, "kv", 4096)
        send_descriptor(a, "kv", fd)
        with pytest.raises(TransferError, match="has 4096 bytes, not 8192"):
            receive_mapping(b, "kv", 8192)
        a.send(b"kv")  # a message without a descriptor
        with pytest.raises(TransferError, match="no descriptor came for region 'kv'"):
            receive_mapping(b, "kv", 4096)
        with pytest.raises(TransferError, match="must be positive"):
            create_private(0)
    finally:
        os.close(fd)
        a.close()
        b.close()
