"""Is a rendezvous port usable? `hetc launch` asks before torchrun waits minutes on a taken one.

Note [probing the rendezvous port]
torchrun's c10d rendezvous hosts a TCPStore on the endpoint's port when the
endpoint is an address of its machine; when the port is taken, it falls back
to being a client of whatever listens there, and a program that is not a
store never answers: the agent waits out its timeouts, 90-150 s, without a
word. So before torchrun starts, the port is tried as the store would take it
(every interface, SO_REUSEADDR, so that connections of a past run in
TIME_WAIT do not count):
- it binds: the port is free (released at once for torchrun to bind it);
- the endpoint is not an address of this machine: another node hosts the
  store, and it may well not be up yet (the nodes start in any order), so
  neither a refused nor an accepted connection would prove anything; nothing
  is probed, and torchrun's own timeouts apply;
- it is in use: it may be the store of this job's first node on this machine
  (several `hetc launch` on one host, as with the default 127.0.0.1:29500), so
  the listener is asked what a TCPStore client asks first (validate, then
  check a key; torch's own client cannot be bounded in time, it waited ten
  minutes on a silent listener). A store answers within a moment; anything
  else is "taken". tests/test_signals.py checks this question against torch's
  TCPStore, so that a change of torch's protocol shows there.
"""

from __future__ import annotations

import errno
import socket
import struct

__all__ = ["STORE_ANSWER_TIMEOUT_S", "rendezvous_port_problem"]

STORE_ANSWER_TIMEOUT_S = 3.0
# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: the first message a client sends, and a query that is
# answered with one byte (CheckResponseType READY = 0 or NOT_READY = 1); little-endian, as torch sends them
_VALIDATE, _CHECK, _MAGIC = 0, 5, 0x3C85F7CE
_PROBE_KEY = b"hetc/rdzv-port-probe"


def rendezvous_port_problem(host: str, port: int) -> str | None:
    """Why torchrun could neither host nor join a store at HOST:PORT, or None, also where that cannot be
    told from this machine (Note [probing the rendezvous port])."""
    if not _is_this_host(host) or _store_could_bind(port):
        return None
    if _answers_as_store(host, port):
        return None         # another node of the job, on this machine, hosts the store
    return f"port {port} is in use on this machine by a program that is not a torch rendezvous store"


def _is_this_host(host: str) -> bool:
    """Whether HOST names an address of this machine (binding to it works)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False        # torchrun says what it makes of a name that does not resolve
    for family, _, _, _, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def _store_could_bind(port: int) -> bool:
    """Whether a TCPStore could listen on `port`: torch binds every interface, IPv6 with IPv4 mapped."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue        # no IPv6 here
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind((wildcard, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return False
                continue
            return True
    return True             # nothing to bind with: let torchrun find out


def _answers_as_store(host: str, port: int) -> bool:
    query = struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<BQQ", _CHECK, 1, len(_PROBE_KEY)) + _PROBE_KEY
    try:
        with socket.create_connection((host, port), timeout=STORE_ANSWER_TIMEOUT_S) as sock:
            sock.sendall(query)
            return sock.recv(1) in (b"\x00", b"\x01")
    except OSError:         # refused (bound, not listening), reset, or no answer in time
        return False
