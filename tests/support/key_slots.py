"""Redis Cluster's hash slots, and what a workload sent to Redis grouped as Cluster would have to route it:
each MULTI/EXEC (with the keys WATCHed before it), each script call (its KEYS and the keys its commands
touched) and each other command, with their keys.

The slot of a key is CRC16 (XMODEM: polynomial 0x1021, initial value 0) of the key, or of its hash tag (what
lies between its first `{` and the next `}`, when that is not empty), modulo 16384. The commands come from
MONITOR, which shows every command the server runs, in the order it runs them: a transaction's commands at its
EXEC, a script's own commands (client `lua`) right after the script's call. Which arguments of a command are
keys is asked of Redis itself (COMMAND GETKEYS), so nothing here knows a command's syntax.
"""

from __future__ import annotations

import inspect
import re
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import redis

from shared.keys import Keys

NUM_SLOTS = 16384
SCRIPT_CALLS = frozenset({b"EVAL", b"EVALSHA", b"EVAL_RO", b"EVALSHA_RO", b"FCALL", b"FCALL_RO"})


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-XMODEM, the checksum Redis Cluster hashes keys with."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[(crc >> 8) ^ byte]
    return crc


def hashed_part(key: str | bytes) -> bytes:
    """What of the key its slot is computed from: its hash tag, or all of it."""
    raw = key.encode() if isinstance(key, str) else key
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            return raw[start + 1 : end]
    return raw


def key_slot(key: str | bytes) -> int:
    return crc16(hashed_part(key)) % NUM_SLOTS


# -- which Keys method names a key -----------------------------------------------------------------------

_HOLE = "\x00"
NOT_KEYS = frozenset({"prefix", "control", "celery_prefix", "all_patterns"})


class KeyKinds:
    """Tells, of a key name, which method of Keys builds it ("inbox", "tokens", ...): "celery" for Celery's
    keys, None for a name under the prefix that no method builds, "" for a name of another prefix."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        templates: list[tuple[str, re.Pattern[str]]] = []
        for name, member in inspect.getmembers(Keys):
            if name.startswith("_") or name in NOT_KEYS:
                continue
            if isinstance(member, property):
                template = getattr(keys, name)
            else:
                holes = [_HOLE] * (len(inspect.signature(member).parameters) - 1)
                template = getattr(keys, name)(*holes)
            pattern = re.escape(template).replace(re.escape(_HOLE), "(.+?)")
            templates.append((name, re.compile(pattern)))
        # The longest literal first: `...:worker:w1:inbox` is the inbox's, not a worker named `w1:inbox`.
        self._templates = sorted(templates, key=lambda t: -len(t[1].pattern.replace("(.+?)", "")))

    def kind(self, key: str) -> str | None:
        if not key.startswith(self.keys.prefix + ":"):
            return ""
        if key.startswith(self.keys.celery_prefix):
            return "celery"
        for name, pattern in self._templates:
            if pattern.fullmatch(key):
                return name
        return None


# -- MONITOR -------------------------------------------------------------------------------------------------

_LINE = re.compile(rb"^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$", re.S)
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"', re.S)
_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a", ord("b"): b"\b"}


def unescape(quoted: bytes) -> bytes:
    """An argument as MONITOR quotes it (backslash escapes, \\xHH for other bytes), as sent."""
    out, i = bytearray(), 0
    while i < len(quoted):
        byte = quoted[i]
        if byte != ord("\\") or i + 1 == len(quoted):
            out.append(byte)
            i += 1
            continue
        nxt = quoted[i + 1]
        if nxt == ord("x") and i + 3 < len(quoted):
            out.append(int(quoted[i + 2 : i + 4], 16))
            i += 4
        else:
            out += _ESCAPES.get(nxt, bytes([nxt]))
            i += 2
    return bytes(out)


def parse_line(line: bytes) -> tuple[str, list[bytes]] | None:
    """(client address, or "lua" for a script's own commands; the command's arguments) of a MONITOR line."""
    match = _LINE.match(line)
    if match is None:
        return None
    return match.group(1).decode(), [unescape(arg) for arg in _ARG.findall(match.group(2))]


class Monitor:
    """Records every command the Redis at url runs while it is open (MONITOR, read on a thread of its own)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client = redis.Redis.from_url(url)
        self._marker = f"monitor-end-{uuid.uuid4().hex}".encode()
        self.lines: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> Monitor:
        self._conn = self._client.connection_pool.make_connection()
        self._conn.connect()
        self._conn.send_command("MONITOR")
        assert self._conn.read_response() in (b"OK", "OK")
        self._thread.start()
        return self

    def _read(self) -> None:
        while True:
            line = self._conn.read_response()
            assert isinstance(line, bytes)
            if self._marker in line:
                return
            self.lines.append(line)

    def __exit__(self, *exc: object) -> None:
        self._client.echo(self._marker)  # the last line it records: everything before it has been read
        self._thread.join(timeout=60)
        self._conn.disconnect()
        self._client.close()
        assert not self._thread.is_alive(), "MONITOR never showed its end marker"


# -- groups: what Cluster routes as one ----------------------------------------------------------------------


@dataclass
class Group:
    """Commands Redis Cluster would have to run on one node: a MULTI/EXEC, a script call, or one command."""

    what: str  # "MULTI" (with its WATCH), "EVALSHA" and the like, or the command's name
    client: str  # address, and the name it gave itself (CLIENT SETNAME)
    commands: list[list[bytes]] = field(default_factory=list)
    declared: set[str] = field(default_factory=set)  # a script's KEYS (after keys())
    touched: set[str] = field(default_factory=set)  # the keys of its commands (after keys())
    inner: list[list[bytes]] = field(default_factory=list)  # a script's own commands

    @property
    def keys(self) -> set[str]:
        return self.declared | self.touched

    def slots(self) -> set[int]:
        return {key_slot(key) for key in self.keys}

    def undeclared(self) -> set[str]:
        """Keys a script touched that it did not pass as KEYS (Cluster routes a script by its KEYS)."""
        return self.touched - self.declared if self.what.encode() in SCRIPT_CALLS else set()

    def describe(self) -> str:
        names = " ".join(c[0].decode(errors="replace").upper() for c in self.commands[:12])
        more = f" (+{len(self.commands) - 12})" if len(self.commands) > 12 else ""
        return f"{self.what} from {self.client}: [{names}{more}] keys {sorted(self.keys)}"


def groups_of(lines: Iterable[bytes]) -> list[Group]:
    """The MONITOR lines as groups, in the order they ran (keys not filled in yet: keys())."""
    names: dict[str, str] = {}
    watching: dict[str, list[list[bytes]]] = {}
    open_multi: dict[str, Group] = {}
    groups: list[Group] = []
    script: tuple[Group, Group | None] | None = None  # the last script call, and the MULTI it ran in
    for line in lines:
        parsed = parse_line(line)
        if parsed is None or not parsed[1]:
            continue
        addr, args = parsed
        if addr == "lua":
            if script is not None:
                for group in script:
                    if group is not None:
                        group.inner.append(args)
            continue
        name = args[0].upper()
        _note_name(names, addr, args)
        client = f"{addr} ({names[addr]})" if addr in names else addr
        if name == b"WATCH":
            watching.setdefault(addr, []).append(args)
        elif name == b"UNWATCH":
            watching.pop(addr, None)
        elif name == b"MULTI":
            open_multi[addr] = Group("MULTI", client, list(watching.pop(addr, [])))
        elif name in (b"EXEC", b"DISCARD"):
            multi = open_multi.pop(addr, None)
            watching.pop(addr, None)
            if multi is not None and name == b"EXEC":
                groups.append(multi)
        else:
            multi = open_multi.get(addr)
            if multi is not None:
                multi.commands.append(args)
            if name in SCRIPT_CALLS:
                call = Group(name.decode(), client, [args])
                groups.append(call)
                script = (call, multi)
            elif multi is None:
                groups.append(Group(name.decode(), client, [args]))
    return groups


def _note_name(names: dict[str, str], addr: str, args: list[bytes]) -> None:
    upper = [a.upper() for a in args]
    if upper[:2] == [b"CLIENT", b"SETNAME"] and len(args) > 2:
        names[addr] = args[2].decode(errors="replace")
    elif upper[0] == b"HELLO" and b"SETNAME" in upper[:-1]:
        names[addr] = args[upper.index(b"SETNAME") + 1].decode(errors="replace")


def fill_keys(client: redis.Redis, groups: list[Group], mentions: bytes) -> list[Group]:
    """The groups whose commands mention `mentions` (a prefix), with their keys as Redis tells them (COMMAND
    GETKEYS: a command without keys has none)."""
    relevant = [g for g in groups if any(mentions in arg for c in (*g.commands, *g.inner) for arg in c)]
    commands = {tuple(c) for g in relevant for c in (*g.commands, *g.inner)}
    found = dict(zip(commands, _getkeys(client, list(commands))))
    for group in relevant:
        is_script = group.what.encode() in SCRIPT_CALLS
        group.declared = set(found[tuple(group.commands[0])]) if is_script else set()
        touched = [c for c in (group.inner if is_script else [*group.commands, *group.inner])]
        group.touched = {key for c in touched for key in found[tuple(c)]}
    return relevant


def _getkeys(client: redis.Redis, commands: list[tuple[bytes, ...]]) -> Iterator[list[str]]:
    for start in range(0, len(commands), 1000):
        pipe = client.pipeline(transaction=False)
        for command in commands[start : start + 1000]:
            pipe.execute_command("COMMAND GETKEYS", *command)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):  # "The command has no key arguments", or no command at all
                yield []
            else:
                yield [k.decode() if isinstance(k, bytes) else str(k) for k in reply]
