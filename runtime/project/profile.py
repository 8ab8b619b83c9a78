"""Hardware profiles (docs/projection.md §3): TOML files whose every constant cites its source.

```toml
[profile]
name = "cm384"
description = "CloudMatrix384: Ascend 910C dies on the UB plane"

[link]
port_gbps = { value = 196, source = "000 §3.3.1 (l.206-211): 7 x 224 Gbps per die" }
[aiv]
t_row_us = { value = 0.05, source = "placeholder", calibrated = true, points = ["..."] }
[dma]
startup_us = { unknown = true, source = "000 §4.2.1 (l.387): 'considerable', no number" }
```

A constant is `{value, source}`, `{value, source, calibrated = true, points = [...]}` or
`{unknown = true, source}`; sections and keys are those of `SCHEMA`. Anything else is refused,
naming the file and the key, when the profile loads; a constant that is unknown or absent is
refused only when a projection needs it (`Profile.get`), naming it: a capture with no DMA stream
projects on a profile whose DMA startup is unknown.

`--profile NAME` reads `runtime/project/profiles/NAME.toml` (package data); an argument with a
`/` or ending in `.toml` is a path. `host` is the built-in self-replay profile (no file): each
event costs what it took on the capturing machine (docs/projection.md §2 item 7).
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from runtime.project.errors import ProjectError

# section -> key -> meaning (units in the key's suffix: _us, _ms, _gbps = GB/s, _tflops, _gb)
SCHEMA: dict[str, dict[str, str]] = {
    "die": {
        "aiv_cores": "AI vector cores per die",
        "aic_cores": "AI cube cores per die",
        "bf16_tflops": "dense BF16 peak per die",
        "int8_tflops": "INT8 (or FP8) peak per die",
        "hbm_gbps": "HBM bandwidth per die",
        "hbm_gb": "HBM capacity per die",
        "dies_per_node": "dies per node: intra- vs inter-node latency (node = die // this)",
    },
    "link": {
        "port_gbps": "bandwidth of each die's egress and of its ingress port (unidirectional)",
        "write_latency_us": "a remote write's latency, inter-node (after the transfer)",
        "write_latency_intra_us": "a remote write's latency, same node",
        "read_latency_us": "a remote read's latency, inter-node (before the transfer)",
        "read_latency_intra_us": "a remote read's latency, same node",
        "d2d_gbps": "die-to-die bandwidth inside a package, per direction (not used yet)",
    },
    "aiv": {
        "b_core_gbps": "MTE throughput of one vector core (a transfer's rate = cores x this)",
        "t_row_us": "per-message (row) work of a put, spread over the stream's cores",
        "t_tok_us": "per-token work of a put (quantize, offsets), spread over the cores",
        "t_put_us": "fixed cost of issuing one put",
        "t_flag_us": "cost of writing one guard word (pub), spread over the cores",
        "t_poll_us": "cost of the check that ends a guarded wait (acq)",
    },
    "collective": {
        "cores": "vector cores of a collective kernel stream (a2a*)",
        "t_fixed_us": "launch cost of a dispatch / combine / a2e / e2a call (its begin)",
    },
    "p2p": {"t_fixed_us": "launch cost of a send / recv / isend / irecv call (its begin)"},
    "dma": {
        "startup_us": "startup of a DMA (URMA) transfer, before its bytes move",
        "gbps": "throughput of the DMA engine",
    },
    "efficiency": {
        "vector_memory": "achieved / peak HBM bandwidth of a vector (aiv) op",
        "mla_compute": "achieved / peak FLOPs of an op named mla",
        "mla_memory": "achieved / peak HBM bandwidth of an op named mla",
        "gemm_int8": "achieved / peak FLOPs (and bandwidth) of an INT8 cube op",
        "gemm_bf16": "achieved / peak FLOPs (and bandwidth) of a BF16 cube op",
    },
    "runtime": {
        "graph_launch_ms": "startup of one compute graph (not used yet)",
        "iteration_gap_ms": "scheduling gap between decode iterations (not used yet)",
        "stream0_aic": "cube cores of decode stream s0 (the attention path of a micro-batch)",
        "stream0_aiv": "vector cores of decode stream s0",
        "stream1_aic": "cube cores of decode stream s1 (the MoE path of a micro-batch)",
        "stream1_aiv": "vector cores of decode stream s1",
    },
}
HOST = "host"
COUNTS = {"die.aiv_cores", "die.aic_cores", "die.dies_per_node", "collective.cores",
          "runtime.stream0_aic", "runtime.stream0_aiv", "runtime.stream1_aic",
          "runtime.stream1_aiv"}  # fmt: skip
FORMS = (
    "{value = number, source = str}",
    "{value = number, source = str, calibrated = true, points = [str, ...]}",
    "{unknown = true, source = str}",
)


@dataclass(frozen=True, slots=True)
class Profile:
    """A loaded profile.

    name: `[profile] name` ("host" for the built-in). path: the file read ("<built-in>" for
    host). sha256: of the file's bytes (for host: of the text "xpod host profile 1").
    values: "section.key" -> number. unknown: "section.key" -> source of a constant marked
    unknown. sources: "section.key" -> source of every constant. calibrated: "section.key" ->
    {"value": v, "points": [...]} for the fitted constants.
    """

    name: str
    path: str
    description: str
    sha256: str
    values: dict[str, float] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    calibrated: dict[str, dict] = field(default_factory=dict)

    @property
    def is_host(self) -> bool:
        """The built-in self-replay profile (host times, no constants)."""
        return self.path == "<built-in>"

    def get(self, key: str) -> float:
        """The value of constant `key` ("section.key"); ProjectError if the profile lacks it or
        marks it unknown (the projection needs it: fail closed, never a silent default)."""
        try:
            return self.values[key]
        except KeyError:
            pass
        where = f"profile {self.name} ({self.path})"
        if key in self.unknown:
            raise ProjectError(
                f"{where}: {key} is unknown (source: {self.unknown[key]}); this projection needs it"
            )
        raise ProjectError(f"{where}: lacks {key}; this projection needs it")


def load_profile(name_or_path: str) -> Profile:
    """The profile `name_or_path`: `host`, a shipped profile's name (`cm384`, `h800`) or a path
    to a TOML file (one with a `/` or ending in `.toml`). ProjectError names the file and key
    of anything the schema does not allow."""
    if name_or_path == HOST:
        return host_profile()
    if "/" in name_or_path or name_or_path.endswith(".toml"):
        path = Path(name_or_path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ProjectError(f"{path}: cannot read the profile: {e.strerror or e}") from e
        return parse_profile(data, str(path))
    shipped = resources.files("runtime.project") / "profiles" / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise ProjectError(
            f"profile {name_or_path!r}: no such profile (shipped: {', '.join(shipped_names())},"
            f" {HOST}; or a path to a .toml file)"
        )
    return parse_profile(shipped.read_bytes(), f"runtime/project/profiles/{name_or_path}.toml")


def shipped_names() -> list[str]:
    """Names of the profiles shipped in runtime/project/profiles/, sorted."""
    folder = resources.files("runtime.project") / "profiles"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def host_profile() -> Profile:
    """The self-replay profile: host times, zero latencies, unlimited ports (no constants)."""
    sha = hashlib.sha256(b"xpod host profile 1").hexdigest()
    return Profile(HOST, "<built-in>", "this machine's measured event times", sha)


def parse_profile(data: bytes, where: str) -> Profile:
    """Parse and check a profile's bytes; `where` names the file in errors."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ProjectError(f"{where}: not a TOML file: {e}") from e
    head = doc.get("profile")
    if not isinstance(head, dict):
        raise ProjectError(f"{where}: lacks the [profile] section (name, description)")
    for key in sorted(set(head) | {"name", "description"}):
        if key not in ("name", "description"):
            raise ProjectError(f"{where}: profile.{key}: unknown key (allowed: name, description)")
        if not isinstance(head.get(key), str) or not head[key].strip():
            raise ProjectError(f"{where}: profile.{key} must be a non-empty string")
    prof = Profile(head["name"], where, head["description"], hashlib.sha256(data).hexdigest())
    for section, table in doc.items():
        if section == "profile":
            continue
        if section not in SCHEMA:
            raise ProjectError(
                f"{where}: [{section}]: unknown section (allowed: profile, {', '.join(SCHEMA)})"
            )
        if not isinstance(table, dict):
            raise ProjectError(f"{where}: {section} must be a table")
        for key, const in table.items():
            _add_constant(prof, where, section, key, const)
    return prof


def _add_constant(prof: Profile, where: str, section: str, key: str, const: object) -> None:
    name = f"{section}.{key}"
    if key not in SCHEMA[section]:
        allowed = ", ".join(SCHEMA[section])
        raise ProjectError(f"{where}: {name}: unknown key (allowed in [{section}]: {allowed})")
    if not isinstance(const, dict):
        raise ProjectError(f"{where}: {name} must be a table, one of {' | '.join(FORMS)}")
    source = const.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ProjectError(f"{where}: {name} lacks its source (a non-empty string)")
    keys = set(const)
    if keys == {"unknown", "source"}:
        if const["unknown"] is not True:
            raise ProjectError(f"{where}: {name}: unknown must be true")
        prof.unknown[name] = source
    elif keys in ({"value", "source"}, {"value", "source", "calibrated", "points"}):
        prof.values[name] = _value(where, name, const["value"])
        if "calibrated" in keys:
            points = _points(where, name, const)
            prof.calibrated[name] = {"value": prof.values[name], "points": points}
    elif keys == {"value", "source", "calibrated"}:
        raise ProjectError(f"{where}: {name} is calibrated but names no points")
    else:
        raise ProjectError(
            f"{where}: {name} has keys {sorted(keys)}; a constant is one of {' | '.join(FORMS)}"
        )
    prof.sources[name] = source


def _value(where: str, name: str, value: object) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProjectError(f"{where}: {name}: value {value!r} is not a finite number")
    value = float(value)
    timed = name.endswith(("_us", "_ms"))
    if value < 0 or (value == 0 and not timed):
        want = ">= 0" if timed else "> 0"
        raise ProjectError(f"{where}: {name}: value {value:g} must be {want}")
    if name.startswith("efficiency.") and value > 1:
        raise ProjectError(f"{where}: {name}: value {value:g} is an efficiency, at most 1")
    if name in COUNTS and value != int(value):
        raise ProjectError(f"{where}: {name}: value {value:g} must be a whole number")
    return value


def _points(where: str, name: str, const: dict) -> list[str]:
    if const["calibrated"] is not True:
        raise ProjectError(f"{where}: {name}: calibrated must be true")
    points = const["points"]
    if not isinstance(points, list) or not points or not all(isinstance(p, str) for p in points):
        raise ProjectError(f"{where}: {name} is calibrated but names no points (a list of str)")
    return list(points)


__all__ = ["HOST", "SCHEMA", "Profile", "host_profile", "load_profile", "parse_profile",
           "shipped_names"]  # fmt: skip
