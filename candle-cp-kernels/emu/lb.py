#!/usr/bin/env python3
"""Reads a kernel file preprocessed with -DCP_EMU_LB_SCAN (stdin), where emu.h turned each
`__launch_bounds__(ARGS)` into `CP_EMU_LB_MARK(ARGS)`, and writes it (stdout) with the marker
removed and `::cp_emu::launch_bounds("ENTRY", ARGS);` inserted at the top of the entry's body,
so that every thread of a launch checks its block size against the entry's bound.
Fails (exit 1) on a marker it cannot place. Used by emu/run.sh."""
import re
import sys

MARK = "CP_EMU_LB_MARK("


def close(s, i):
    """Index just past the parenthesis that closes the one opened before s[i]."""
    depth = 1
    while depth:
        if i >= len(s):
            raise ValueError("unbalanced parentheses")
        depth += {"(": 1, ")": -1}.get(s[i], 0)
        i += 1
    return i


def main():
    src = sys.stdin.read()
    out, pos, n = [], 0, 0
    while True:
        m = src.find(MARK, pos)
        if m < 0:
            break
        a = m + len(MARK)
        e = close(src, a)
        args = src[a:e - 1].strip()
        name = re.compile(r"\s*([A-Za-z_]\w*)\s*\(").match(src, e)
        if not name:
            sys.exit(f"lb.py: no entry name after {src[m:e]}")
        body = close(src, name.end())
        brace = re.compile(r"\s*\{").match(src, body)
        if not brace:
            sys.exit(f"lb.py: no body after entry {name.group(1)}")
        out += [src[pos:m], src[e:brace.end()], f' ::cp_emu::launch_bounds("{name.group(1)}", {args});']
        pos = brace.end()
        n += 1
    out.append(src[pos:])
    sys.stdout.write("".join(out))
    sys.stderr.write(f"lb.py: {n} entries\n") if "-v" in sys.argv else None


if __name__ == "__main__":
    main()
