"""A cloud-init NoCloud seed: `meta-data` and `user-data` on an ISO 9660 image labelled
`cidata`, which cloud-init finds on any block device by its label.

The image is written here, in Python, with no host tool (genisoimage, xorriso) and no
dependency: a NoCloud seed is two small files in one directory, which ISO 9660 with Joliet
names (for `meta-data`'s lower case and hyphen) holds in a few fixed sectors. The layout:

    sectors 0-15   system area (zeros)
    16             primary volume descriptor (8.3 names: META_DAT.;1)
    17             Joliet supplementary volume descriptor (UCS-2 names: meta-data)
    18             volume descriptor set terminator
    19-22          path tables (L and M, primary then Joliet): the root only
    23, 24         the root directory, primary then Joliet
    25-            the files' data, each from a sector of its own

Both directory trees point at the same data. Linux (and cloud-init through it) reads the Joliet
names; `blkid` reports `TYPE=iso9660 LABEL=cidata`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from datetime import UTC, datetime

import yaml

SECTOR = 2048
LABEL = "cidata"


def seed_files(instance_id: str, hostname: str, ssh_keys: list[str]) -> dict[str, bytes]:
    """NoCloud's `meta-data` (the instance and its host name) and `user-data` (#cloud-config:
    the host name and the tenant's SSH public keys). cloud-init gives the keys to the image's
    default user and to root; `disable_root: false` lets root use them (by default cloud-init
    prefixes root's with a command that only says which user to log in as), since `root` is
    the user a tenant connects as, in a VM as in a container. Keys are written one per line
    (`- KEY`), never folded."""
    meta = {"instance-id": instance_id, "local-hostname": hostname}
    user = {"hostname": hostname, "disable_root": False, "ssh_authorized_keys": list(ssh_keys)}
    dump = dict(default_flow_style=False, sort_keys=False, width=1 << 20, allow_unicode=False)
    return {
        "meta-data": yaml.safe_dump(meta, **dump).encode(),
        "user-data": b"#cloud-config\n" + yaml.safe_dump(user, **dump).encode(),
    }


def _both16(n: int) -> bytes:
    return struct.pack("<H", n) + struct.pack(">H", n)


def _both32(n: int) -> bytes:
    return struct.pack("<I", n) + struct.pack(">I", n)


def _record_date(at: datetime) -> bytes:
    return bytes([at.year - 1900, at.month, at.day, at.hour, at.minute, at.second, 0])


def _volume_date(at: datetime | None) -> bytes:
    if at is None:
        return b"0" * 16 + b"\x00"
    return at.strftime("%Y%m%d%H%M%S00").encode() + b"\x00"


def _dir_record(name: bytes, extent: int, size: int, at: datetime, is_dir: bool) -> bytes:
    length = 33 + len(name) + (1 if len(name) % 2 == 0 else 0)
    record = bytes([length, 0]) + _both32(extent) + _both32(size) + _record_date(at)
    record += bytes([2 if is_dir else 0, 0, 0]) + _both16(1) + bytes([len(name)]) + name
    return record.ljust(length, b"\x00")


def _primary_name(name: str, taken: set[bytes]) -> bytes:
    """An ISO 9660 level 1 name (`META_DAT.;1`): upper case d-characters, 8.3, unique."""
    stem = re.sub(r"[^A-Z0-9_]", "_", name.upper())[:8] or "FILE"
    candidate, n = stem, 1
    while f"{candidate}.;1".encode() in taken:
        suffix = str(n)
        candidate, n = stem[: 8 - len(suffix)] + suffix, n + 1
    out = f"{candidate}.;1".encode()
    taken.add(out)
    return out


def _text(value: str, size: int, joliet: bool) -> bytes:
    """A descriptor's text field: a-characters padded with spaces, or UCS-2 for Joliet."""
    if joliet:
        return (value.encode("utf-16-be") + " ".encode("utf-16-be") * size)[:size]
    return value.encode("ascii")[:size].ljust(size, b" ")


def _descriptor(
    kind: int,
    label: str,
    sectors: int,
    path_table: tuple[int, int, int],
    root: bytes,
    at: datetime,
) -> bytes:
    joliet = kind == 2
    size, l_table, m_table = path_table
    d = bytearray(SECTOR)
    d[0] = kind
    d[1:6] = b"CD001"
    d[6] = 1
    d[8:40] = _text("LINUX", 32, joliet)
    d[40:72] = _text(label, 32, joliet)
    d[80:88] = _both32(sectors)
    if joliet:
        d[88:91] = b"%/E"  # UCS-2 level 3
    d[120:124] = _both16(1)
    d[124:128] = _both16(1)
    d[128:132] = _both16(SECTOR)
    d[132:140] = _both32(size)
    d[140:144] = struct.pack("<I", l_table)
    d[148:152] = struct.pack(">I", m_table)
    d[156:190] = root
    for start, length in ((190, 128), (318, 128), (446, 128), (574, 128)):
        d[start : start + length] = _text("", length, joliet)
    d[574:702] = _text("RACKPLANE", 128, joliet)
    for start in (702, 739, 776):
        d[start : start + 37] = _text("", 37, joliet)[:37]
    d[813:830] = _volume_date(at)
    d[830:847] = _volume_date(at)
    d[847:864] = _volume_date(None)
    d[864:881] = _volume_date(None)
    d[881] = 1
    return bytes(d)


def _path_table(root_extent: int, little: bool) -> bytes:
    extent = struct.pack("<I" if little else ">I", root_extent)
    parent = struct.pack("<H" if little else ">H", 1)
    return bytes([1, 0]) + extent + parent + b"\x00\x00"


def iso9660(files: Mapping[str, bytes], label: str = LABEL, at: datetime | None = None) -> bytes:
    """An ISO 9660 image (with Joliet names) holding `files` in its root directory."""
    at = (at or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None)
    names = sorted(files)
    first_data = 25
    extents: dict[str, int] = {}
    sector = first_data
    for name in names:
        extents[name] = sector
        sector += max(1, -(-len(files[name]) // SECTOR))
    total = sector
    primary_root, joliet_root = 23, 24

    def directory(root_extent: int, joliet: bool) -> bytes:
        out = _dir_record(b"\x00", root_extent, SECTOR, at, True)
        out += _dir_record(b"\x01", root_extent, SECTOR, at, True)
        taken: set[bytes] = set()
        for name in names:
            ident = f"{name};1".encode("utf-16-be") if joliet else _primary_name(name, taken)
            out += _dir_record(ident, extents[name], len(files[name]), at, False)
        if len(out) > SECTOR:
            raise ValueError("too many files for a one-sector directory")
        return out.ljust(SECTOR, b"\x00")

    image = bytearray(16 * SECTOR)
    for kind, root_extent, tables in ((1, primary_root, (19, 20)), (2, joliet_root, (21, 22))):
        root = _dir_record(b"\x00", root_extent, SECTOR, at, True)
        image += _descriptor(kind, label, total, (10, *tables), root, at)
    terminator = bytearray(SECTOR)
    terminator[0:7] = b"\xffCD001\x01"
    image += terminator
    for root_extent in (primary_root, joliet_root):
        image += _path_table(root_extent, True).ljust(SECTOR, b"\x00")
        image += _path_table(root_extent, False).ljust(SECTOR, b"\x00")
    image += directory(primary_root, False)
    image += directory(joliet_root, True)
    for name in names:
        data = files[name]
        image += data.ljust(max(1, -(-len(data) // SECTOR)) * SECTOR, b"\x00")
    assert len(image) == total * SECTOR, (len(image), total)
    return bytes(image)
