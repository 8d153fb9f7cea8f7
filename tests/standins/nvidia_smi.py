"""A stand-in `nvidia-smi` for tests: MIG mode, GPU instances and compute instances kept in a
JSON file (`$RACKPLANE_FAKE_GPU_STATE`), so the agent's MIG applier runs its real commands
without a GPU (docs/design/mig-layouts.md §3).

    {"gpus": [{"index", "uuid", "name", "memory_mib", "bus_id", "mig_current", "mig_pending",
               "pids": [...], "gis": [{"id", "profile", "start", "cis": [{"id", "uuid"}]}]}],
     "next_gi_id": N}

Only what the memo lists is modelled: `-L`; `-i N -mig 0|1`; `-i N --query-gpu=mig.mode.current,
mig.mode.pending --format=csv,noheader`; `--query-compute-apps=gpu_uuid,pid --format=csv,
noheader`; `mig -i N` with `-lgi`, `-lci`, `-lgip`, `-cgi a,b,... [-C]`, `-cci`, `-dci [-gi X]`,
`-dgi [-gi X]`. Anything else exits 2 with usage. The geometry table here is its own, copied
from shared/reference/gpu.md, not imported from app/placement/mig.py: an independent oracle.
The driver's real placement policy is unknown: the lowest free valid start is taken, or the
highest with `FAKE_SMI_PLACEMENT=highest`. `FAKE_SMI_LOG=FILE` appends each argv (JSON) to FILE.
Exit codes are not the real tool's (not verified): 0 on success, 2 for usage, else 1 or 6.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import uuid

# shape key -> (compute slices, memory slices, valid starts, NVML GI profile id)
SHAPES = {
    "1g": (1, 1, (0, 1, 2, 3, 4, 5, 6), 19),
    "1g.2m": (1, 2, (0, 2, 4, 6), 15),
    "2g": (2, 2, (0, 2, 4), 14),
    "3g": (3, 4, (0, 4), 9),
    "4g": (4, 4, (0,), 5),
    "7g": (7, 8, (0,), 0),
}
_ORDER = ("1g", "1g.2m", "2g", "3g", "4g", "7g")
# NVML product name -> (memory MiB, profile names in _ORDER)
MODELS = {
    "NVIDIA A100-SXM4-80GB": (
        81920,
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    ),
    "NVIDIA H100 80GB HBM3": (
        81559,
        ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    ),
    "NVIDIA H200": (
        143771,
        ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    ),
}
COMPUTE, MEMORY, MAX_GIS = 7, 8, 7
# The compute-instance profile filling a GPU instance of this many compute slices (`-C`).
CI_PROFILE_IDS = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}


def shapes(name: str) -> dict[str, tuple[int, int, tuple[int, ...], int]]:
    """A model's profile names -> (compute, memory, starts, profile id)."""
    _, names = MODELS[name]
    return {n: SHAPES[k] for n, k in zip(names, _ORDER, strict=True)}


def mask(memory: int, start: int) -> int:
    return ((1 << memory) - 1) << start


# --- the state file ------------------------------------------------------------------------


def state_path() -> str:
    path = os.environ.get("RACKPLANE_FAKE_GPU_STATE")
    if not path:
        sys.stderr.write("RACKPLANE_FAKE_GPU_STATE is not set\n")
        raise SystemExit(9)
    return path


@contextlib.contextmanager
def locked(write: bool):
    """The state under flock (shared to read, exclusive to change); written atomically."""
    path = state_path()
    with open(path + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        with open(path) as fh:
            state = json.load(fh)
        yield state
        if write:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(state, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)


def new_state(path: str, names: list[str]) -> None:
    """A host with these GPUs (NVML names), all whole and idle."""
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{uuid.uuid4()}",
            "name": name,
            "memory_mib": MODELS[name][0],
            "bus_id": f"00000000:{0x18 + i:02X}:00.0",
            "mig_current": 0,
            "mig_pending": 0,
            "pids": [],
            "gis": [],
        }
        for i, name in enumerate(names)
    ]
    with open(path, "w") as fh:
        json.dump({"gpus": gpus, "next_gi_id": 1}, fh, indent=1)


# --- the commands --------------------------------------------------------------------------

USAGE = "usage (stand-in): nvidia-smi [-L | -i N -mig 0|1 | -i N --query-gpu=... | mig ...]\n"


class Exit(Exception):
    def __init__(self, code: int, text: str = ""):
        self.code, self.text = code, text


def usage() -> Exit:
    return Exit(2, USAGE)


def _gpu(state: dict, index: str | None) -> dict:
    if index is None or not index.isdigit():
        raise usage()
    for g in state["gpus"]:
        if g["index"] == int(index):
            return g
    raise Exit(6, f"No devices were found matching index {index}\n")


def _bus(g: dict) -> str:
    return g["bus_id"]


def list_gpus(state: dict) -> str:
    out = []
    for g in state["gpus"]:
        out.append(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        if g["mig_current"]:
            n = 0
            for gi in sorted(g["gis"], key=lambda x: x["id"]):
                for ci in gi["cis"]:
                    out.append(f"  MIG {gi['profile']:<11} Device {n:>2}: (UUID: {ci['uuid']})")
                    n += 1
    return "\n".join(out) + "\n"


def set_mode(g: dict, mode: str) -> str:
    if mode not in ("0", "1"):
        raise usage()
    want = int(mode)
    word = "Enabled" if want else "Disabled"
    if want == 0 and g["gis"]:
        raise Exit(
            1,
            f"Unable to disable MIG Mode for GPU {_bus(g)}: In use by another client\n",
        )
    g["mig_pending"] = want
    if g["pids"] and g["mig_current"] != want:
        state_word = "enable" if want else "disable"
        return (
            f"Warning: MIG mode is in pending {state_word} state for GPU {_bus(g)}:"
            "In use by another client\n"
            f"{_bus(g)} is currently being used by one or more other processes "
            "(e.g. CUDA application or a monitoring application such as another instance of "
            "nvidia-smi). Please first kill all processes using the device and retry the "
            "command or reboot the system to make MIG mode effective.\nAll done.\n"
        )
    g["mig_current"] = want
    return f"{word} MIG Mode for GPU {_bus(g)}\nAll done.\n"


def query_modes(g: dict) -> str:
    def word(v: int) -> str:
        return "Enabled" if v else "Disabled"

    return f"{word(g['mig_current'])}, {word(g['mig_pending'])}\n"


def compute_apps(state: dict) -> str:
    return "".join(f"{g['uuid']}, {pid}\n" for g in state["gpus"] for pid in g["pids"])


def _start_for(g: dict, compute: int, memory: int, starts: tuple[int, ...]) -> int | None:
    used = used_compute = 0
    table = shapes(g["name"])
    for gi in g["gis"]:
        c, m, _, _ = table[gi["profile"]]
        used |= mask(m, gi["start"])
        used_compute += c
    if used_compute + compute > COMPUTE or len(g["gis"]) >= MAX_GIS:
        return None
    free = [s for s in starts if not (mask(memory, s) & used)]
    if not free:
        return None
    return max(free) if os.environ.get("FAKE_SMI_PLACEMENT") == "highest" else min(free)


def _profile(g: dict, token: str) -> str | None:
    """A `-cgi` token (a profile id, `3g.40gb` or `MIG 3g.40gb`) -> the model's name."""
    table = shapes(g["name"])
    token = token.strip()
    if token.upper().startswith("MIG "):
        token = token[4:].strip()
    if token in table:
        return token
    if token.isdigit():
        for name, (_, _, _, pid) in table.items():
            if pid == int(token):
                return name
    return None


def _new_ci(g: dict, gi: dict) -> str:
    ci = {"id": 0, "uuid": f"MIG-{uuid.uuid4()}"}
    gi["cis"].append(ci)
    table = shapes(g["name"])
    return (
        f"Successfully created compute instance ID  {ci['id']} on GPU {g['index']:>2} GPU "
        f"instance ID {gi['id']:>2} using profile MIG {gi['profile']} "
        f"(ID {CI_PROFILE_IDS[table[gi['profile']][0]]:>2})\n"
    )


def create_gis(state: dict, g: dict, tokens: str, with_ci: bool) -> str:
    out = []
    table = shapes(g["name"])
    for token in tokens.split(","):
        name = _profile(g, token)
        if name is None:
            raise Exit(
                1,
                "".join(out)
                + f"Unable to create a GPU instance on GPU {g['index']:>2} using profile "
                f"{token.strip()}: Invalid Argument\n"
                "Failed to create GPU instances: Invalid Argument\n",
            )
        why = None
        if g["pids"]:
            why = "In use by another client"
        else:
            c, m, starts, _ = table[name]
            start = _start_for(g, c, m, starts)
            if start is None:
                why = "Insufficient Resources"
        if why is not None:
            # The GPU instances this call made before stay, as on real runs.
            raise Exit(
                1,
                "".join(out)
                + f"Unable to create a GPU instance on GPU {g['index']:>2} using profile "
                f"{name}: {why}\nFailed to create GPU instances: {why}\n",
            )
        gi = {"id": state["next_gi_id"], "profile": name, "start": start, "cis": []}
        state["next_gi_id"] += 1
        g["gis"].append(gi)
        out.append(
            f"Successfully created GPU instance ID {gi['id']:>2} on GPU {g['index']:>2} using "
            f"profile MIG {name} (ID {table[name][3]:>2})\n"
        )
        if with_ci:
            out.append(_new_ci(g, gi))
    return "".join(out)


def _select(g: dict, gi_id: str | None) -> list[dict]:
    if gi_id is None:
        return list(g["gis"])
    if not gi_id.isdigit():
        raise usage()
    return [gi for gi in g["gis"] if gi["id"] == int(gi_id)]


def create_cis(g: dict, gi_id: str | None) -> str:
    gis = [gi for gi in _select(g, gi_id) if not gi["cis"]]
    if not gis:
        raise Exit(6, "No GPU instances found: Not Found\n")
    return "".join(_new_ci(g, gi) for gi in gis)


def destroy_cis(g: dict, gi_id: str | None) -> str:
    gis = [gi for gi in _select(g, gi_id) if gi["cis"]]
    if not gis:
        raise Exit(6, "No compute instances found: Not Found\n")  # [assumption]
    if g["pids"]:
        gi = gis[0]
        raise Exit(
            1,
            f"Unable to destroy compute instance ID  0 from GPU {g['index']:>2} GPU instance "
            f"ID {gi['id']:>2}: In use by another client\n"
            "Failed to destroy compute instances: In use by another client\n",
        )
    out = []
    for gi in gis:
        for ci in gi["cis"]:
            out.append(
                f"Successfully destroyed compute instance ID {ci['id']:>2} from GPU "
                f"{g['index']:>2} GPU instance ID {gi['id']:>2}\n"
            )
        gi["cis"] = []
    return "".join(out)


def destroy_gis(g: dict, gi_id: str | None) -> str:
    gis = _select(g, gi_id)
    if not gis:
        raise Exit(6, "No GPU instances found: Not Found\n")  # [assumption]
    out = []
    for gi in gis:
        if gi["cis"] or g["pids"]:
            raise Exit(
                1,
                "".join(out)
                + f"Unable to destroy GPU instance ID {gi['id']:>2} from GPU {g['index']:>2}: "
                "In use by another client\nFailed to destroy GPU instances: In use by another "
                "client\n",
            )
        g["gis"].remove(gi)
        out.append(
            f"Successfully destroyed GPU instance ID {gi['id']:>2} from GPU {g['index']:>2}\n"
        )
    return "".join(out)


def list_gis(g: dict) -> str:
    table = shapes(g["name"])
    if not g["gis"]:
        raise Exit(6, "No GPU instances found: Not Found\n")
    rows = [
        "+---------------------------------------------------+",
        "| GPU instances:                                    |",
        "| GPU   Name          Profile  Instance   Placement |",
        "|                       ID       ID       Start:Size|",
        "|===================================================|",
    ]
    for gi in sorted(g["gis"], key=lambda x: x["id"]):
        _, m, _, pid = table[gi["profile"]]
        rows.append(
            f"|  {g['index']:>2}  MIG {gi['profile']:<9} {pid:>4}  {gi['id']:>8}"
            f"  {gi['start']:>7}:{m:<2}|"
        )
    rows.append("+---------------------------------------------------+")
    return "\n".join(rows) + "\n"


def list_cis(g: dict) -> str:
    cis = [(gi, ci) for gi in sorted(g["gis"], key=lambda x: x["id"]) for ci in gi["cis"]]
    if not cis:
        raise Exit(6, "No compute instances found: Not Found\n")
    rows = [
        "+--------------------------------------------------------------------+",
        "| Compute instances:                                                 |",
        "| GPU     GPU       Name             Profile   Instance              |",
        "|       Instance                       ID        ID                  |",
        "|         ID                                                         |",
        "|====================================================================|",
    ]
    for gi, ci in cis:
        rows.append(
            f"|  {g['index']:>2}  {gi['id']:>6}       MIG {gi['profile']:<12} {0:>4}  "
            f"{ci['id']:>8}   {ci['uuid'][:14]:<14}|"
        )
    rows.append("+--------------------------------------------------------------------+")
    return "\n".join(rows) + "\n"


def list_profiles(g: dict) -> str:
    rows = ["| GPU   Name             ID    Instances   Memory slices   Compute |"]
    for name, (c, m, starts, pid) in shapes(g["name"]).items():
        rows.append(
            f"|  {g['index']:>2}  MIG {name:<12} {pid:>3}  {len(starts):>9}  {m:>14}  {c:>7} |"
        )
    return "\n".join(rows) + "\n"


def _opt(args: list[str], flag: str) -> str | None:
    if flag in args:
        i = args.index(flag)
        if i + 1 >= len(args):
            raise usage()
        value = args[i + 1]
        del args[i : i + 2]
        return value
    return None


def _mig(args: list[str]) -> str:
    index = _opt(args, "-i")
    gi_id = _opt(args, "-gi")
    if index is None or not args:
        raise usage()
    writes = args[0] in ("-cgi", "-cci", "-dci", "-dgi")
    with locked(write=writes) as state:
        g = _gpu(state, index)
        if not g["mig_current"]:
            raise Exit(6, "No MIG-enabled devices found.\n")
        cmd, rest = args[0], args[1:]
        if cmd == "-lgi" and not rest:
            return list_gis(g)
        if cmd == "-lci" and not rest:
            return list_cis(g)
        if cmd == "-lgip" and not rest:
            return list_profiles(g)
        if cmd == "-cgi" and rest and rest[1:] in ([], ["-C"]):
            return create_gis(state, g, rest[0], with_ci=rest[1:] == ["-C"])
        if cmd == "-cci" and not rest:
            return create_cis(g, gi_id)
        if cmd == "-dci" and not rest:
            return destroy_cis(g, gi_id)
        if cmd == "-dgi" and not rest:
            return destroy_gis(g, gi_id)
    raise usage()


def run(argv: list[str]) -> str:
    args = list(argv)
    if args == ["-L"]:
        with locked(write=False) as state:
            return list_gpus(state)
    if args == ["--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]:
        with locked(write=False) as state:
            return compute_apps(state)
    if args and args[0] == "mig":
        return _mig(args[1:])
    index = _opt(args, "-i")
    if index is not None and len(args) == 2 and args[0] == "-mig":
        with locked(write=True) as state:
            return set_mode(_gpu(state, index), args[1])
    if index is not None and args == [
        "--query-gpu=mig.mode.current,mig.mode.pending",
        "--format=csv,noheader",
    ]:
        with locked(write=False) as state:
            return query_modes(_gpu(state, index))
    raise usage()


def main(argv: list[str]) -> int:
    log = os.environ.get("FAKE_SMI_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps(argv) + "\n")
    try:
        sys.stdout.write(run(argv))
    except Exit as exc:
        sys.stdout.write(exc.text)
        return exc.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
