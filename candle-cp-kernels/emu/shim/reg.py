#!/usr/bin/env python3
"""Reads a preprocessed kernel file (stdin) and writes it (stdout) with one registration per
`extern "C"` kernel entry *definition* appended (the expansion of `CP_EMU_REGISTER(entry)`, as
the output is compiled with -x c++-cpp-output: no further preprocessing), so the host CUDA shim
(emu/shim/) can look the entry up by name and launch it with the driver's kernelParams. The
file must have been preprocessed with `-include registry.h`. Declarations (`...;`) are skipped. Exit 1 if no
entry is found (a file compiled for the shim without kernels is a build mistake).
Usage: reg.py [--list] < file.ii > file.reg.ii"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lb import close  # noqa: E402  (emu/lb.py: index past the parenthesis that closes)

ENTRY = re.compile(r'extern\s+"C"\s+((?:[^;{}()"]|\((?:[^()]|\([^()]*\))*\))*?)\bvoid\s+([A-Za-z_]\w*)\s*\(')


def entries(src):
    names = []
    for m in ENTRY.finditer(src):
        end = close(src, m.end())
        rest = re.compile(r"\s*(\{|;)").match(src, end)
        if rest and rest.group(1) == "{":
            names.append(m.group(2))
    return names


def main():
    src = sys.stdin.read()
    names = entries(src)
    if not names:
        sys.exit("reg.py: no extern \"C\" kernel entry found")
    if "--list" in sys.argv:
        print("\n".join(names))
        return
    seen = set()
    if "cp_emu::KernelReg" not in src and "struct KernelReg" not in src:
        sys.exit("reg.py: registry.h is not in the preprocessed file (preprocess with -include registry.h)")
    out = [src, "\n"]
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(f'static ::cp_emu::KernelReg cp_emu_reg_{n}("{n}", &::cp_emu::thunk<&{n}>, '
                       f"::cp_emu::Arity<decltype(&{n})>::value);\n")
    sys.stdout.write("".join(out))


if __name__ == "__main__":
    main()
