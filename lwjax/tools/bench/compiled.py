"""What a compiled step holds, read from XLA: its memory, its collectives, its attention kernel.

:func:`collectives` counts the collective instructions of a compiled module's text as written;
:func:`step_collectives` counts what one call runs: a loop's body as many times as the loop
turns, a conditional by its cheapest branch, collectives over groups of one device left out.
"""

from __future__ import annotations

import math
import re

from lwjax.tools.bench.profile import COLLECTIVE_KINDS


def compiled_summary(compiled) -> dict:
    """``compiled_bytes_per_device`` (:func:`compiled_bytes`), ``attention`` (``"cudnn"`` where
    the step calls cuDNN's fused attention, else ``"xla"``) and ``collectives``
    (:func:`collectives`) of a compiled step."""
    text = compiled.as_text()
    return dict(
        compiled_bytes_per_device=compiled_bytes(compiled),
        attention="cudnn" if "cudnn$fmha" in text else "xla",
        collectives=collectives(text),
    )


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per collective kind, ``(instances, result elements)`` in an optimized HLO module's text.

    A tuple-shaped result (combined collectives, ``*-start`` ops) counts all its
    arrays; kinds: ``all-reduce``, ``reduce-scatter``, ``all-gather``.
    """
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)  # XLA's /*index=5*/ notes hold an "="
    out = {}
    for kind in COLLECTIVE_KINDS:
        sizes = []
        for match in re.finditer(rf"= (\(?[^=]*?\)?) {kind}(-start)?\(", hlo_text):
            shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match[1])
            sizes.append(sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes))
        out[kind] = (len(sizes), sum(sizes))
    return out


# Bytes of an element of each HLO type a collective moves.
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_HLO_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
STEP_COLLECTIVE_KINDS = (*COLLECTIVE_KINDS, "all-to-all")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_OP = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(STEP_COLLECTIVE_KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def step_collectives(hlo_text: str) -> dict[str, tuple[int, int, int]]:
    """Per collective kind, ``(executions, result elements, result bytes)`` of one call of an
    optimized HLO module (kinds: :data:`STEP_COLLECTIVE_KINDS`).

    Unlike :func:`collectives`, a collective inside a ``while`` loop counts once per turn
    (XLA's ``known_trip_count``), a ``conditional`` counts its branch that moves the fewest
    bytes (the gradient norm's overflow path runs only when a norm overflows), and a
    collective whose replica groups are all one device (a copy; XLA keeps some) is left out.
    Bytes are the types XLA emits: the CPU backend moves bf16 collectives as f32.

    Raises:
      ValueError: a loop without a known trip count, or a module without an entry.
    """
    hlo_text = re.sub(r"/\*.*?\*/", "", hlo_text)
    bodies, entry, name = {}, None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            name = header[2]
            bodies[name] = []
            entry = name if header[1] else entry
        elif name is not None and line.strip() != "}":
            bodies[name].append(line)
    if entry is None:
        raise ValueError("step_collectives: the HLO text has no ENTRY computation.")
    memo: dict[str, dict[str, list[int]]] = {}

    def totals(computation: str) -> dict[str, list[int]]:
        if computation not in memo:
            out = {kind: [0, 0, 0] for kind in STEP_COLLECTIVE_KINDS}
            for line in bodies.get(computation, ()):
                for sub, times in _called(line):
                    _add(out, totals(sub) if times else _cheapest(sub, totals), times or 1)
                op = _OP.search(line)
                if op and not _within_one_device(line):
                    shapes = [
                        (t, math.prod(int(d) for d in dims.split(",") if d))
                        for t, dims in _SHAPE.findall(op[1])
                    ]
                    count = out[op[2]]
                    count[0] += 1
                    count[1] += sum(n for _, n in shapes)
                    count[2] += sum(n * _HLO_BYTES[t] for t, n in shapes)
            memo[computation] = out
        return memo[computation]

    return {kind: tuple(v) for kind, v in totals(entry).items()}


def _called(line: str) -> list[tuple]:
    """``(computation, times)`` an instruction runs: a loop body ``n`` times; for a
    conditional, one ``(branches, 0)`` entry (the caller takes the cheapest)."""
    if " while(" in line:
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        if trips is None:
            raise ValueError(
                f"step_collectives: a loop without a known trip count: {line.strip()[:120]}"
            )
        return [(re.search(r"body=%([\w.\-]+)", line)[1], int(trips[1]))]
    if " conditional(" in line:
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = (
            branches[1]
            if branches
            else ",".join(re.findall(r"(?:true|false)_computation=(%[\w.\-]+)", line))
        )
        return [(tuple(n.strip().lstrip("%") for n in names.split(",")), 0)]
    called = re.search(r" (?:call|async-start)\(.*(?:to_apply|calls)=%([\w.\-]+)", line)
    return [(called[1], 1)] if called else []


def _cheapest(branches: tuple[str, ...], totals) -> dict[str, list[int]]:
    return min((totals(b) for b in branches), key=lambda t: sum(v[2] for v in t.values()))


def _add(out: dict[str, list[int]], inner: dict[str, list[int]], times: int) -> None:
    for kind, values in inner.items():
        out[kind] = [a + times * b for a, b in zip(out[kind], values)]


def _within_one_device(line: str) -> bool:
    """Whether every replica group of the instruction is a single device."""
    listed = re.search(r"replica_groups=\{(.*?)\}\}?,", line)
    if listed:
        return all(g.count(",") == 0 for g in re.findall(r"\{([^{}]*)\}", listed[0]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return iota is not None and iota[2] == "1"


def compiled_bytes(compiled) -> int | None:
    """Device memory of a compiled step: arguments + outputs − donated + temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def widened_arguments(hlo_text: str) -> int:
    """Bytes of the fp32 copies XLA's CPU backend makes of whole bf16/fp16 arguments and
    carries through a loop: in the entry computation, a conversion whose one operand is such
    an argument, whose result is fp32 of the same shape, and which a ``while`` takes in.

    The CPU backend computes 16-bit matrix products and collectives in fp32; in a scanned
    model it converts each stacked weight once, before the scan, and the scan carries the
    copy: the step holds every layer's weights a second time, at twice their bytes, while
    it runs. A GPU computes in bf16 and makes no such copy: these bytes are the CPU
    estimate's alone.
    """
    entry = hlo_text[hlo_text.find("\nENTRY ") :]
    entry = re.sub(r"/\*.*?\*/", "", entry)  # XLA's /*index=5*/ notes
    half = dict(re.findall(r"%(\S+) = (?:bf16|f16)\[([0-9,]*)\]\{[^}]*\} parameter\(", entry))
    widened = {
        name: 4 * math.prod(int(d) for d in dims.split(",") if d)
        for name, dims, operand in re.findall(
            r"%(\S+) = f32\[([0-9,]*)\]\{[^}]*\} (?:fusion|convert)\(%([^,)]+)\)", entry
        )
        if half.get(operand) == dims
    }
    tuples = dict(re.findall(r"%(\S+) = \(.*?\) tuple\(([^)]*)\)", entry))
    carried = set()
    for loop_input in re.findall(r" while\(%([^)]+)\)", entry):
        carried |= {a.strip().lstrip("%") for a in tuples.get(loop_input, "").split(",")}
    return sum(size for name, size in widened.items() if name in carried)
