"""Reading what ptxas and cuobjdump say about a compiled kernel: registers and spills from `ptxas -v`, and from the
SASS the main loop, the widths of its global loads and its length per KB of data loaded (see benchmarks/static_report.py
for the method). Used by `python -m benchmarks.static_report`.
"""

from __future__ import annotations

import re
import subprocess
import tempfile

_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BRANCH = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?BRA(?:\.\S+)?\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
_LDG = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?LDG((?:\.[A-Z0-9_]+)*)\s")


def ldg_bits(instruction: str) -> int | None:
    """Width in bits of a global load (LDG.E.128 -> 128, LDG.E.U16 -> 16, LDG.E -> 32), None if not an LDG."""
    match = _LDG.match(instruction)
    if match is None:
        return None
    for suffix in match.group(1).split("."):
        if suffix in ("128", "64"):
            return int(suffix)
        if suffix in ("U16", "S16", "U8", "S8"):
            return int(suffix[1:])
    return 32


def sass_instructions(cubin: bytes) -> list[tuple[int, str]]:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True, check=True
        )
    return [(int(addr, 16), text) for addr, text in _SASS_LINE.findall(sass.stdout)]


def main_loop(instructions: list[tuple[int, str]]) -> tuple[list[str], bool]:
    """The instructions of the main loop: of the innermost loops (a backward branch with none inside its body), the one
    with the most LDGs, the longest on a tie (e.g. the loops before and after the target's tile); or, when no loop
    loads, the whole kernel up to its last EXIT. And whether it was a loop."""
    branches = []  # (index of the branch, index of its target)
    for i, (addr, text) in enumerate(instructions):
        branch = _BRANCH.match(text)
        if branch and int(branch.group(1), 16) <= addr:
            branches.append((i, next(j for j, (a, _) in enumerate(instructions) if a >= int(branch.group(1), 16))))
    loops = []
    for i, start in branches:
        if not any(start <= other < i for other, _ in branches):
            body = [text for _, text in instructions[start : i + 1]]
            loops.append((sum(ldg_bits(t) is not None for t in body), len(body), body))
    loops = [loop for loop in loops if loop[0]]
    if loops:
        return max(loops, key=lambda loop: loop[:2])[2], True
    last_exit = max(i for i, (_, t) in enumerate(instructions) if re.search(r"\bEXIT\b", t))
    return [t for _, t in instructions[: last_exit + 1]], False


def ptxas_report(log: str) -> dict:
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if spills is None or regs is None:
        raise RuntimeError(f"no ptxas -v report in the compile log:\n{log}")
    return {
        "registers": int(regs.group(1)),
        "stack_bytes": int(spills.group(1)),
        "spill_store_bytes": int(spills.group(2)),
        "spill_load_bytes": int(spills.group(3)),
    }


def measure(kernel, log: str, reads_logits: bool) -> dict:
    """ptxas's registers and spills of a triton CompiledKernel and, for a kernel that streams logits, its main loop's
    loads, length, bytes loaded per iteration and warp instructions per KB."""
    out = ptxas_report(log)
    if reads_logits:
        num_warps = kernel.metadata.num_warps
        body, is_loop = main_loop(sass_instructions(kernel.asm["cubin"]))
        widths = [bits for bits in map(ldg_bits, body) if bits is not None]
        bytes_per_iteration = sum(widths) // 8 * 32 * num_warps
        out |= {
            "loop": is_loop,
            "loop_instructions": len(body),
            "loop_ldg_bits": sorted(widths, reverse=True),
            "bytes_per_iteration": bytes_per_iteration,
            "instructions_per_kb": round(len(body) * num_warps * 1024 / bytes_per_iteration, 1),
        }
    return out
