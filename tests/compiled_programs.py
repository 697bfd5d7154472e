"""Reading compiled XLA programs: what each device is given, and the collectives inside loops.

A number equal on 1 and 8 devices proves the math, not the split (STYLE.md). These helpers read
what each device's program does from `jax.jit(f).lower(...).compile()`: its entry parameters
(per-device shapes, keyed by the argument path jax records in their metadata) and, from
`compiled.as_text()` (the optimised, SPMD-partitioned HLO, whose shapes are per device), the
collectives and the computations they sit in.

    compiled = jax.jit(f, in_shardings=...).lower(*args).compile()
    per_device_parameter_shapes(compiled)["state.tokens_BxC"]   # (2, 6): 16 rows over 8 devices
    collectives_in_while_bodies(compiled.as_text())
    # [Collective(op='all-reduce', shape='f32[4,1,128]', bytes=2048, groups=((0, 1), (2, 3), ...)), ...]

Only the HLO text is parsed (no XLA internals), so the helpers work on any backend's output.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

# Bytes per element of the HLO element types a model program uses.
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Cross-device ops; async pairs count once, at "-start" (its "-done" carries the same buffers).
COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                  "collective-permute", "collective-broadcast", "all-gather-start", "all-reduce-start",
                  "collective-permute-start")

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\((.*?)\)(?:,|$)")
_CALLED_ONE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALLED_MANY = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_PARAMETER_NUMBER = re.compile(r"\bparameter\((\d+)\)")


class Collective(NamedTuple):
    op: str      # e.g. "all-gather"
    shape: str   # its result type, e.g. "f32[64,32]" or "(f32[4], f32[4])"
    bytes: int   # the larger of its result's and its operands' bytes (per device)
    groups: tuple  # the partitions that communicate: ((0, 1), (2, 3), ...); see `device_groups`


class Instruction(NamedTuple):
    name: str
    op: str
    type: str              # the result type as printed
    operands: tuple        # operand instruction names
    called: tuple          # computations it calls (fusion bodies, while body/condition, reducers)
    line: str


def _iota(text: str) -> np.ndarray:
    """XLA's iota tile format "[4,2]<=[8]" / "[2,4]<=[4,2]T(1,0)" (or just "[4,2]T(1,0)"): an
    arange reshaped to the <= dims, transposed by T, reshaped to the leading dims."""
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
    if not m:
        raise ValueError(f"unrecognised iota device list {text!r}")
    dims = [int(d) for d in m.group(1).split(",")]
    source = [int(d) for d in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(source)).reshape(source)
    if m.group(3):
        ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return ids.reshape(dims)


def device_groups(line: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    """The groups of partitions (devices, in the mesh's flat order) a collective runs among.

    Reads the formats XLA prints: explicit `replica_groups={{0,1},{2,3}}` (or `{}`: all together),
    iota `replica_groups=[4,2]<=[8]`, named axes `replica_groups=mesh['axis_0'=4,'axis_1'=2]
    [, device_ids=([4,2]T(1,0))] {'axis_1'}` (devices that differ only along the listed axes), and
    a collective-permute's `source_target_pairs={{0,1},...}` (each pair a group)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2) is None:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        elif "[" in m.group(2):
            ids = _iota(m.group(2)).reshape(sizes)
        else:
            ids = np.array([int(i) for i in m.group(2).split(",")]).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        kept = [i for i in range(len(names)) if i not in grouped]
        ids = ids.transpose(kept + grouped).reshape(-1, math.prod(sizes[i] for i in grouped))
        return tuple(tuple(int(i) for i in row) for row in ids)
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        return tuple(tuple(int(i) for i in row) for row in _iota(m.group(1)))
    m = re.search(r"(replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = tuple(tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(2)))
        return groups or (tuple(range(num_partitions)),)
    raise ValueError(f"no device groups recognised in: {line.strip()[:300]}")


def shape_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type ("f32[4,8]{1,0}", or a tuple of them)."""
    return sum(_DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _SHAPE.findall(type_text))


def parse_computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """Computation name -> its instructions, for every computation of an HLO module's text.

    The entry computation is also under the key "ENTRY"."""
    out: dict[str, list[Instruction]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = []
            out[header.group(2)] = current
            if header.group(1):
                out["ENTRY"] = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        called = _CALLED_ONE.findall(line)
        for group in _CALLED_MANY.findall(line):
            called += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        current.append(Instruction(name=m.group(1), op=m.group(3), type=m.group(2),
                                   operands=tuple(re.findall(r"%([\w.\-]+)", m.group(4))),
                                   called=tuple(called), line=line))
    return out


def entry_parameters(hlo_text: str) -> list[tuple[str, str]]:
    """(argument path, per-device type) of each entry parameter, in parameter order.

    The path is the `op_name` jax writes into the parameter's metadata: "params['embed'].value",
    "state.tokens_BxC", "rng" (the parameter's HLO name where there is none)."""
    params = []
    for ins in parse_computations(hlo_text)["ENTRY"]:
        if ins.op != "parameter":
            continue
        number = int(_PARAMETER_NUMBER.search(ins.line).group(1))
        name = _OP_NAME.search(ins.line)
        path = name.group(1).replace("\\'", "'").replace('\\"', '"') if name else ins.name
        params.append((number, path, re.sub(r"\{[^}]*\}", "", ins.type)))
    return [(path, type_) for _, path, type_ in sorted(params)]


def per_device_parameter_shapes(compiled) -> dict[str, tuple[int, ...]]:
    """Argument path -> the shape one device's program takes for it (`compiled` a jax Compiled).

    From the entry computation's parameters in `compiled.as_text()`: on a mesh these are shard
    shapes (16 rows over data*fsdp = 8 read (2, ...)), not the global shapes of `args_info`."""
    out = {}
    for path, type_ in entry_parameters(compiled.as_text()):
        (dims,) = [d for _, d in _SHAPE.findall(type_)]
        out[path] = tuple(int(d) for d in dims.split(",") if d)
    return out


def while_body_computations(hlo_text: str) -> set[str]:
    """Names of the computations a while loop's body runs: every while's body and everything it
    calls, transitively (fusions, nested loops, reducers)."""
    comps = parse_computations(hlo_text)
    todo = [c for ins_list in comps.values() for ins in ins_list if ins.op == "while"
            for c in re.findall(r"\bbody=%?([\w.\-]+)", ins.line)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [c for ins in comps[name] for c in ins.called]
    return seen


def collectives(hlo_text: str, computations: set[str] | None = None) -> list[Collective]:
    """Every collective in the module (or in `computations`), with its per-device bytes."""
    comps = parse_computations(hlo_text)
    partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
    num_partitions = int(partitions.group(1)) if partitions else 1
    found = []
    for name, instructions in comps.items():
        if name == "ENTRY" or (computations is not None and name not in computations):
            continue
        types = {ins.name: ins.type for ins in instructions}
        for ins in instructions:
            if ins.op in COLLECTIVE_OPS:
                size = max([shape_bytes(ins.type)] + [shape_bytes(types.get(o, "")) for o in ins.operands])
                found.append(Collective(ins.op, re.sub(r"\{[^}]*\}", "", ins.type), size,
                                        device_groups(ins.line, num_partitions)))
    return found


def collectives_in_while_bodies(hlo_text: str) -> list[Collective]:
    """The collectives that run at every iteration of some while loop (see `while_body_computations`):
    in a decode loop, once per generated token."""
    return collectives(hlo_text, while_body_computations(hlo_text))
