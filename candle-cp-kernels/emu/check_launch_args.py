#!/usr/bin/env python3
"""Static check of every Rust kernel launch against the kernel's parameter list (no GPU).

cudarc's launch builder passes untyped pointers to cuLaunchKernel: a wrong argument order, a
wrong width (i32 vs i64, f32 vs f64), a view of the wrong element type or a missing argument is
silent memory corruption on the GPU. This script checks, mechanically:

  1. Rust side: every `get_or_load_custom_func(NAME, ..)` in candle-cp-kernels/src/**.rs followed
     by `func.builder()`, its `.arg(..)` sequence up to `.launch(`, each value's type resolved
     from its binding (`as i32`, `0i32`, `util::view::<T>`, `dev.alloc::<T>`, fn parameters,
     `fn args(..) -> Result<(i32, i64, ..)>`), the generic element type (`T`, `$ty`) bound from the
     kernel name's dtype suffix (or the `go!(ty, "name")` macro invocation).
  2. C side: each `extern "C" __global__` entry of kernels/*.cu, macros expanded by the C
     preprocessor (system includes stripped, so no CUDA headers are needed): C types, pointer
     element types, constness (an output pointer must be pushed as `&mut`).
  3. PTX (optional, `--ptx-dir DIR`: DIR/candle-cp-kernels-*/out/*.ptx, e.g. DIR = target/release/
     build, or DIR/*.ptx; the newest file of each name): each entry's
     `.param` widths must equal the C widths, and its `.maxntid` (from `__launch_bounds__`) must
     equal the block size the launcher uses.
  4. Tile configs (tile_configs()): the constants the launch shapes derive from, read on both
     sides (PIPES / PipeCfg<D> / FusedCfg<D> / WGMMA_* / the CUDA-core and mma kernels' constexprs
     vs flash.rs pipe_config and block/row literals (flash/bwd.rs for the backward), bwd_pipe.rs PipeCfg::of, bwd_fused.rs NW/BQ,
     sm90.rs WGMMA_*), must agree; block threads, rows per block and dynamic shared memory follow.
  5. dtype dispatch (`DType::F16 => go!(f16, ..)` / `launch_x!(f16)` / `fwd_t::<f16>`), and the
     launch config of the one-warp-per-row kernels (delta, pipe prep, merge, top-K: grid ceil(rows / 4),
     block 128) and of the grid-stride kernels (layout, cast, dequant, dropout: `grid_stride_blocks`).

Not covered: the order of two pushed values of the same type (e.g. B and T, both int), grid
dimensions beyond rows per block, and the shared-memory formulas themselves (transcribed from
both sides in tile_configs(), reviewed by hand).

Exit status 1 with one line per mismatch; 0 with a summary line. Usage (repo root):
  python3 candle-cp-kernels/emu/check_launch_args.py [--ptx-dir target/release/build]
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_launch_sm90 import wgmma_bwd_configs, wgmma_ws_bwd_configs, wgmma_ws_configs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # candle-cp-kernels
SRC = os.environ.get("CHECK_LAUNCH_SRC", os.path.join(ROOT, "src"))  # override: self-test on edited copies
KERN = os.path.join(ROOT, "kernels")

# dtype suffix of a kernel name -> Rust element type
SFX_TY = {"f32": "f32", "f16": "f16", "bf16": "bf16", "u32": "u32", "u8": "u8"}
# C scalar / element types -> (class, bytes) and Rust element type
C_ELEM = {"float": "f32", "__half": "f16", "__nv_bfloat16": "bf16", "unsigned int": "u32",
          "uint32_t": "u32", "unsigned char": "u8", "uint8_t": "u8", "double": "f64", "long long": "i64"}
C_SCALAR = {"int": ("int", 4), "unsigned int": ("int", 4), "unsigned": ("int", 4), "long long": ("int", 8),
            "unsigned long long": ("int", 8), "size_t": ("int", 8), "int64_t": ("int", 8),
            "float": ("float", 4), "double": ("float", 8),
            # a TMA tensor map by value (kernels/tma.cuh; `const __grid_constant__ CpTmaMap`)
            "CpTmaMap": ("tmap", 128)}
RUST_SCALAR = {"i32": ("int", 4), "u32": ("int", 4), "i64": ("int", 8), "u64": ("int", 8),
               "usize": ("int", 8), "f32": ("float", 4), "f64": ("float", 8),
               "TmaMap": ("tmap", 128)}  # src/flash/tma.rs
PTX_W = {"u64": 8, "s64": 8, "b64": 8, "f64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": 4,
         "u16": 2, "s16": 2, "b16": 2, "u8": 1, "s8": 1, "b8": 1}

errors = []


def err(msg):
    errors.append(msg)


# ---------------------------------------------------------------- C side
def c_entries():
    strip = lambda s: re.sub(r"^\s*#\s*include\s*<[^>]*>.*$", "", s, flags=re.M)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for h in glob.glob(os.path.join(KERN, "*.cuh")):
            with open(h) as f, open(os.path.join(tmp, os.path.basename(h)), "w") as g:
                g.write(strip(f.read()))
        for cu in sorted(glob.glob(os.path.join(KERN, "*.cu"))):
            with open(cu) as f:
                src = strip(f.read())
            r = subprocess.run(["cpp", "-P", "-x", "c++", "-std=c++17", "-I", tmp, "-"], input=src,
                               capture_output=True, text=True)
            if r.returncode:
                err(f"{cu}: preprocessing failed: {r.stderr.strip()[:300]}")
                continue
            pat = (r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
                   r"(\w+)\s*\(([^)]*)\)")
            for name, params in re.findall(pat, r.stdout):
                ps = []
                for p in params.split(","):
                    p = " ".join(p.replace("__restrict__", " ").replace("__grid_constant__", " ").split())
                    m = re.match(r"^(const\s+)?([\w\s]+?)\s*(\*?)\s*(\w+)$", p.replace("*", " * "))
                    if not m:
                        err(f"{os.path.basename(cu)}: {name}: cannot parse parameter '{p}'")
                        continue
                    const, ty, star, pname = m.group(1), " ".join(m.group(2).split()), m.group(3), m.group(4)
                    if star:
                        if ty not in C_ELEM:
                            err(f"{name}: unknown pointer element type '{ty}'")
                        ps.append(("ptr", C_ELEM.get(ty, ty), bool(const), pname))
                    else:
                        if ty not in C_SCALAR:
                            err(f"{name}: unknown scalar type '{ty}'")
                        ps.append(("scalar", C_SCALAR.get(ty, (ty, 0)), ty, pname))
                out[name] = (os.path.basename(cu), ps)
    return out


def c_width(p):
    return 8 if p[0] == "ptr" else p[1][1]


# ---------------------------------------------------------------- PTX side
def ptx_entries(ptx_dir):
    newest = {}
    # a cargo build dir (candle-cp-kernels-*/out/*.ptx, other crates' PTX ignored) or a folder of PTX
    found = glob.glob(os.path.join(ptx_dir, "candle-cp-kernels-*", "out", "*.ptx")) or glob.glob(os.path.join(ptx_dir, "*.ptx"))
    for f in found:
        b = os.path.basename(f)
        if b not in newest or os.path.getmtime(f) > os.path.getmtime(newest[b]):
            newest[b] = f
    out = {}
    for f in newest.values():
        with open(f) as fh:
            txt = fh.read()
        for m in re.finditer(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)([^{]*)\{", txt):
            # (a by-value struct is a byte array: `.param .align 64 .b8 name[128]`)
            widths = [PTX_W[t] * int(n or 1) for t, n in
                      re.findall(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(?:\[(\d+)\])?", m.group(2))]
            nt = re.search(r"\.maxntid\s+(\d+)", m.group(3))
            out[m.group(1)] = (os.path.basename(f), widths, int(nt.group(1)) if nt else None)
    return out, newest


# ---------------------------------------------------------------- Rust side
def fn_containing(text, pos):
    """Start offset of the innermost `fn` item whose body contains pos (nearest preceding `fn `)."""
    starts = [m.start() for m in re.finditer(r"\bfn\s+\w+", text[:pos])]
    return starts[-1] if starts else 0


def method_tuple_types(all_src, method):
    """Element types of `fn method(..) -> Result<(A, B, ..)>` (generic parameters and tuple
    parameter patterns allowed), or None when there is no such (single) definition."""
    ms = list(re.finditer(r"\bfn\s+" + method + r"\s*(?:<[^>]*>)?\s*\(", all_src))
    if len(ms) != 1:
        return None
    close = matching_paren(all_src, ms[0].end() - 1)
    m = re.match(r"\s*->\s*Result<\(", all_src[close + 1:])
    if not m:
        return None
    start = close + 1 + m.end()
    return [t.strip() for t in split_top(all_src[start:matching_paren(all_src, start - 1)])]


def type_of_rust(ty):
    """('ptr', elem) for a CudaView/CudaSlice type, else ('scalar', ty)."""
    cv = re.search(r"Cuda(?:View|Slice)(?:Mut)?<\s*(?:'\w+\s*,\s*)?(\w+)\s*>", ty)
    return ("ptr", cv.group(1)) if cv else ("scalar", ty)


def elem_of(expr):
    m = re.search(r"(?:view|alloc|alloc_zeros|aligned_copy)::<\s*(\$?\w+)\s*>", expr)
    return m.group(1) if m else None


def resolve(name, text, site, all_src):
    """Rust type of the value `name` pushed at offset `site`: ('ptr', elem) or ('scalar', ty)."""
    fstart = fn_containing(text, site)
    body = text[fstart:site]
    # fn parameter `name: ty`
    sig = re.match(r"fn\s+\w+\s*(?:<[^>]*>)?\s*\((.*?)\)\s*(?:->|\{)", text[fstart:], re.S)
    # latest binding in this fn before the site
    best = None
    for m in re.finditer(r"\blet\s+(?:mut\s+)?(\w+|\([^)]*\))\s*(?::\s*([^=]+))?=\s*(.*?);\s*$", body, re.M | re.S):
        lhs, ann, rhs = m.group(1), m.group(2), m.group(3)
        if ann:  # `let x: Ty = ..` / `let (a, b): (A, B) = ..`
            names = [x.strip().replace("mut ", "") for x in lhs.strip("()").split(",")]
            tys = split_top(ann.strip()[1:-1]) if lhs.startswith("(") and ann.strip().startswith("(") else [ann]
            if name in names and len(tys) == len(names):
                t = type_of_rust(tys[names.index(name)].strip())
                if t[0] == "ptr" or t[1] in RUST_SCALAR:
                    best = t
                    continue
        if lhs.startswith("("):
            names = [x.strip().replace("mut ", "") for x in lhs[1:-1].split(",")]
            if name not in names:
                continue
            i = names.index(name)
            # `x.method()?`, `x.method::<T>()?`, `path::func::<T>(args)?` returning Result<(..)>
            mm = re.match(r"^(?:\w+\.|(?:\w+::)*)(\w+)(?:::<[^>]*>)?\((.*)\)\??$", rhs.strip(), re.S)
            if mm and not rhs.strip().startswith("("):
                tys = method_tuple_types(all_src, mm.group(1))
                best = type_of_rust(tys[i]) if tys and i < len(tys) else None
                continue
            parts = split_top(rhs.strip()[1:-1]) if rhs.strip().startswith("(") else []
            best = scalar_of(parts[i]) if i < len(parts) else None
        elif lhs == name:
            e = elem_of(rhs)
            best = ("ptr", e) if e else scalar_of(rhs)
    if best:
        return best
    # bound by a struct-variant pattern `Enum::Variant { .., name, .. } =>` (match arm): the field's
    # type in the enum's definition `Variant { name: ty, .. }`
    for m in re.finditer(r"\b(\w+)::(\w+)\s*\{([^{}]*)\}\s*(?:if\b[^=]*)?=>", body):
        if name not in [x.strip().split(":")[0].strip() for x in m.group(3).split(",")]:
            continue
        for d in re.finditer(r"\benum\s+" + m.group(1) + r"\b[^{]*\{(.*?)\n\}", all_src, re.S):
            fm = re.search(r"\b" + m.group(2) + r"\s*\{([^{}]*)\}", d.group(1))
            if fm:
                for fld in split_top(fm.group(1)):
                    mm = re.match(r"^\s*" + re.escape(name) + r"\s*:\s*(.*?)\s*$", fld, re.S)
                    if mm:
                        t = type_of_rust(mm.group(1))
                        return t if t[0] == "ptr" or t[1] in RUST_SCALAR else None
    if sig:
        for p in split_top(sig.group(1)):
            mm = re.match(r"^\s*(?:mut\s+)?" + re.escape(name) + r"\s*:\s*(.*)$", p, re.S)
            if mm:
                ty = mm.group(1).strip()
                cv = re.search(r"Cuda(?:View|Slice)(?:Mut)?<\s*(?:'\w+\s*,\s*)?(\w+)\s*>", ty)
                if cv:
                    return ("ptr", cv.group(1))
                if ty in RUST_SCALAR:
                    return ("scalar", ty)
    return None


def scalar_of(expr):
    expr = expr.strip().rstrip("?")
    m = re.search(r"\bas\s+(\w+)\s*\)?$", expr) or re.match(r"^-?[\d_.]+(i32|i64|u32|u64|f32|f64|usize)$", expr)
    if m:
        return ("scalar", m.group(1))
    m = re.match(r"^util::to_(i32|i64)\(", expr)
    if m:
        return ("scalar", m.group(1))
    return None


def split_top(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def matching_paren(text, i):
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    return len(text)


def let_literals(text, var):
    """String literals in the right-hand side of the last `let` binding `var` (alone or in a tuple)."""
    lets = list(re.finditer(r"\blet\s+(?:mut\s+)?(\(?[^=;]*?\b" + var + r"\b[^=;]*?\)?)\s*=", text, re.S))
    if not lets:
        return []
    depth, j = 0, lets[-1].end()
    while j < len(text) and not (text[j] == ";" and depth == 0):  # statement end at depth 0
        depth += text[j] in "([{"
        depth -= text[j] in ")]}"
        j += 1
    return re.findall(r'"(\w+)"', text[lets[-1].end():j])


def name_regex(fmt, literals):
    rx, pos = "", 0
    for m in re.finditer(r"\{(\w*)\}", fmt):
        rx += re.escape(fmt[pos:m.start()])
        if m.group(1) in ("sfx", "d"):
            rx += {"sfx": "(f32|f16|bf16|u32|u8)", "d": r"\d+"}[m.group(1)]
        else:
            lits = literals(m.group(1))
            if not lits:
                err(f"format placeholder {{{m.group(1)}}} in \"{fmt}\": no string literals bound to it")
            rx += "(" + "|".join(map(re.escape, lits)) + ")"
        pos = m.end()
    return "^" + rx + re.escape(fmt[pos:]) + "$"


def rust_sites(c_names):
    files = sorted(glob.glob(os.path.join(SRC, "**", "*.rs"), recursive=True))
    texts = {f: open(f).read() for f in files}
    all_src = "\n".join(texts.values())
    sites = []  # (file:line, [kernel names], {name: elem binding}, [(expr, mut, kind)], launch_block_text)
    for f, text in texts.items():
        rel = os.path.relpath(f, os.path.dirname(ROOT))
        for m in re.finditer(r"get_or_load_custom_func\(", text):
            close = matching_paren(text, m.end() - 1)
            call = split_top(text[m.end():close])
            if len(call) != 3:
                err(f"{rel}: get_or_load_custom_func with {len(call)} arguments")
                continue
            line = text[:m.start()].count("\n") + 1
            where = f"{rel}:{line}"
            b = text.find(".builder()", m.end())
            e = text.find(".launch(", b)
            if b < 0 or e < 0:
                err(f"{where}: no builder()/launch( after get_or_load_custom_func")
                continue
            nexpr = call[0].strip()
            names, binds = [], {}
            if re.match(r'^"\w+"$', nexpr):
                names = [nexpr.strip('"')] if nexpr.strip('"') in c_names else []
            elif nexpr == "$name":
                # macro with ($ty:ty, $name:literal): its invocations after it, before the next macro
                rest = text[m.start():]
                nxt = rest.find("macro_rules!")
                for inv in re.finditer(r"\bgo!\(\s*(\w+)\s*,\s*\"(\w+)\"\s*\)", rest[: nxt if nxt >= 0 else None]):
                    names.append(inv.group(2))
                    binds[inv.group(2)] = inv.group(1)
            else:
                fmt = None
                mm = re.match(r'^&?format!\("([^"]*)"(.*)\)$', nexpr, re.S)
                if mm:
                    fmt = mm.group(1)
                    if "{kernel}" in fmt or "{}" in fmt:  # layout.rs: kernel passed by the callers
                        kernels = set(re.findall(r'\blaunch\(\s*\w+\s*,\s*"(\w+)"', text))
                        for k in sorted(kernels):
                            names += [n for n in c_names if re.match("^" + k + r"_(f32|f16|bf16|u32|u8)$", n)]
                        fmt = None
                elif re.match(r"^&?\w+$", nexpr):
                    var = nexpr.lstrip("&")
                    lets = re.findall(r"let\s+" + var + r'\s*=\s*format!\("([^"]*)"', text[:m.start()])
                    fmt = lets[-1] if lets else None
                    if not lets:
                        err(f"{where}: cannot resolve kernel name '{nexpr}'")
                if fmt is not None:
                    rx = name_regex(fmt, lambda var: let_literals(text[:m.start()], var))
                    names = [n for n in c_names if re.match(rx, n)]
            if not names:
                err(f"{where}: kernel name {nexpr} matches no extern \"C\" entry")
                continue
            block = text[b:e]
            args = []
            for am in re.finditer(r"\.arg\(\s*(&?\s*(?:mut\s+)?)?([\w.$]+)\s*\)", block):
                pre = block[:am.start()]
                loop = re.search(r"for\s+(\w+)\s+in\s+(\w+)\s*\{[^}]*$", pre)
                opt = re.search(r"if\s+let\s+Some\((\w+)\)\s*=\s*(\w+)[^{]*\{[^}]*$", pre)
                kind = "loop" if loop else ("opt" if opt else "one")
                args.append((am.group(2), "mut" in (am.group(1) or ""), kind, b + am.start()))
            cfgs = list(re.finditer(r"LaunchConfig\s*\{(.*?)\}", text[:b], re.S))
            cfg_txt = " ".join(cfgs[-1].group(1).split()) if cfgs else ""
            sites.append((where, f, text, names, binds, args, cfg_txt))
    return sites, all_src


def layout_calls(text):
    """layout.rs callers: launch(x, "kernel", &out, &ARGS, MODE) -> {kernel: [(types of ARGS, has_mode)]}."""
    out = {}
    for m in re.finditer(r'\blaunch\(\s*\w+\s*,\s*"(\w+)"', text):
        call = split_top(text[m.end() - len(m.group(0)) + m.group(0).index("(") + 1: matching_paren(text, m.start() + m.group(0).index("("))])
        k = m.group(1)
        if len(call) != 5:
            err(f"layout.rs: launch(.., \"{k}\", ..) with {len(call)} arguments")
            continue
        extra, mode = call[3].strip(), call[4].strip()
        var = re.match(r"^&(\w+)$", extra)
        if var:  # `let args = [..].map(|v| v as i64);` before the call
            lets = re.findall(r"\blet\s+" + var.group(1) + r"\s*=\s*(.*?);", text[:m.start()], re.S)
            extra = lets[-1].strip() if lets else extra
        arr = re.match(r"^&?\[(.*)\](.*)$", extra, re.S)
        if not arr:
            err(f"layout.rs: cannot count the extra args of launch(.., \"{k}\", ..): {extra}")
            continue
        elems = split_top(arr.group(1))
        ty = re.search(r"as\s+(\w+)", arr.group(2))
        tys = [ty.group(1)] * len(elems) if ty else [scalar_of(x)[1] if scalar_of(x) else None for x in elems]
        out.setdefault(k, []).append((tys, mode != "None"))
    return out


def check():
    cents = c_entries()
    sites, all_src = rust_sites(list(cents))
    launched = set()
    nchecks = 0
    # dtype dispatch: `DType::F16 => go!(f16, ..)` / `launch_bwd!(f16)` / `fwd_t::<f16>(..)`, and the
    # macro invocations pairing an element type with a kernel name or dtype suffix.
    for m in re.finditer(r"DType::(\w+)\s*=>\s*(?:\w+!\(|[\w:]+::<)\s*(\w+)", all_src):
        if m.group(1).lower() != m.group(2):
            err(f"dtype dispatch: DType::{m.group(1)} => element type {m.group(2)}")
    for m in re.finditer(r'\bgo!\(\s*(\w+)\s*,\s*"(\w+)"\s*\)', all_src):
        sfx = m.group(2) if m.group(2) in SFX_TY else (re.search(r"_(f32|f16|bf16|u32|u8)$", m.group(2)) or [None, None])[1]
        if SFX_TY.get(sfx) != m.group(1):
            err(f"go!({m.group(1)}, \"{m.group(2)}\"): element type does not match the dtype suffix")
    # one warp per row, 4 rows per block (`blockIdx.x * 4 + threadIdx.x / 32`): grid ceil(rows / 4), block 128;
    # grid-stride kernels (`gridDim.x * blockDim.x`): any grid and block.
    warp_rows = r"^(flash_bwd_delta_f32|flash_bwd_pipe_prep_\w+|merge_step_\w+|merge_rows_inplace_\w+|moe_top_k_\w+)$"
    stride = r"^(seq_permute|a2a_pack|a2a_unpack|cast_out|add_rows_inplace|dequant_int8|dequant_nf4|dropout_keep)_\w+$"
    for where, f, text, names, binds, args, cfg in sites:
        for kname in names:
            if re.match(warp_rows, kname) and not ("div_ceil(4) as u32, 1, 1)" in cfg and "block_dim: (128, 1, 1)" in cfg):
                err(f"{where}: {kname} runs one warp per row, 4 rows per block: expected grid (rows.div_ceil(4), 1, 1), block (128, 1, 1); got {cfg}")
            if re.match(stride, kname) and "grid_stride_blocks(" not in cfg:
                err(f"{where}: {kname} is a grid-stride kernel: expected grid_stride_blocks(..); got {cfg}")
    srcs = "".join(rd("kernels", os.path.basename(x)) for x in glob.glob(os.path.join(KERN, "*.cu")))
    if srcs.count("blockIdx.x * 4 + threadIdx.x / 32") != 4:
        err("expected 4 kernels with `blockIdx.x * 4 + threadIdx.x / 32` rows (delta, pipe prep, merge_rows: merge_step and "
            "merge_rows_inplace, moe_top_k); update warp_rows")
    for where, f, text, names, binds, args, cfg in sites:
        for kname in names:
            launched.add(kname)
            cfile, cps = cents[kname]
            sfx = re.search(r"_(f32|f16|bf16|u32|u8)(?:_d\d+)?$", kname)
            gen = binds.get(kname) or (SFX_TY[sfx.group(1)] if sfx else None)
            # expand the Rust pushes into a flat list of (type, mut, expr)
            pushes = []
            lay = layout_calls(text) if any(k == "loop" for _, _, k, _ in args) else {}
            for expr, mut, kind, pos in args:
                if kind == "one":
                    t = resolve(expr, text, pos, all_src)
                    if t is None:
                        err(f"{where}: {kname}: cannot resolve the type of .arg({expr})")
                        t = ("?", "?")
                    pushes.append((t, mut, expr))
                    continue
                base = next((k for k in lay if kname.startswith(k + "_")), None)
                if base is None:
                    err(f"{where}: {kname}: conditional/loop pushes but no launch(.., \"{kname}\") caller found")
                    continue
                variants = lay[base]
                if len({(tuple(v[0]), v[1]) for v in variants}) != 1:
                    err(f"{where}: {kname}: callers push different argument lists {variants}")
                tys, has_mode = variants[0]
                if kind == "opt" and has_mode:
                    # `mode: Option<i32>`
                    mt = re.search(r"\bmode\s*:\s*Option<(\w+)>", text)
                    pushes.append((("scalar", mt.group(1) if mt else "?"), mut, expr))
                elif kind == "loop":
                    pushes += [(("scalar", t or "?"), mut, f"{expr}[{i}]") for i, t in enumerate(tys)]
            nchecks += 1
            if len(pushes) != len(cps):
                err(f"{where}: {kname}: Rust pushes {len(pushes)} args, {cfile} takes {len(cps)}")
            for i, ((rk, rt), mut, expr) in enumerate(pushes[: len(cps)]):
                cp = cps[i]
                if rt == "T" or rt == "$ty":
                    rt = gen
                tag = f"{where}: {kname}: arg {i} .arg({expr}) -> {cp[-1]}"
                if cp[0] == "ptr":
                    if rk != "ptr":
                        err(f"{tag}: kernel takes a {cp[1]} pointer, Rust pushes {rt}")
                    elif rt != cp[1]:
                        err(f"{tag}: kernel takes {cp[1]}*, Rust pushes a view of {rt}")
                    elif not cp[2] and not mut:
                        err(f"{tag}: kernel writes through it (non-const {cp[1]}*), Rust pushes it without &mut")
                else:
                    if rk != "scalar" or rt not in RUST_SCALAR:
                        err(f"{tag}: kernel takes {cp[2]}, Rust pushes {rk} {rt}")
                    elif RUST_SCALAR[rt] != cp[1]:
                        err(f"{tag}: kernel takes {cp[2]} {cp[1]}, Rust pushes {rt} {RUST_SCALAR[rt]}")
    return cents, launched, nchecks


def rd(*parts):
    path = os.path.join(SRC, *parts[1:]) if parts[0] == "src" else os.path.join(ROOT, *parts)
    with open(path) as f:
        return f.read()


def num(rx, text, what):
    m = re.search(rx, text, re.S)
    if not m:
        err(f"tile config: cannot find {what} (regex {rx})")
        return None
    return [int(x) for x in m.groups()] if len(m.groups()) > 1 else int(m.group(1))


def core_smem_configs(fwd_cu, bwd_cu, core_rs, num, err):
    """The CUDA-core kernels' shared memory (cp_core_smem<N> in fwd_simple, bwd_dkdv, bwd_dq, N
    evaluated from the kernels' constexprs at each head dim) against src/flash/core.rs smem_bytes
    (`Core::X => a * d + b` floats); returns kind -> d -> the dynamic bytes a launch passes (0
    while static: up to CP_CORE_STATIC_SMEM bytes)."""
    lim = num(r"#define CP_CORE_STATIC_SMEM \((\d+) \* 1024\)", rd("kernels", "common.cuh"), "CP_CORE_STATIC_SMEM")
    rlim = num(r"const STATIC_SMEM: usize = (\d+) \* 1024;", core_rs, "core.rs STATIC_SMEM")
    if lim != rlim:
        err(f"core.rs STATIC_SMEM {rlim} KiB != common.cuh CP_CORE_STATIC_SMEM {lim} KiB")
    ns = re.findall(r"cp_core_smem<([^>]+)>\(\)", fwd_cu) + re.findall(r"cp_core_smem<([^>]+)>\(\)", bwd_cu)
    if len(ns) != 3:
        err(f"expected cp_core_smem<N> in fwd_simple, bwd_dkdv, bwd_dq, found {len(ns)}")
        return lambda kind, d: 0
    consts = [dict(NW=4, R=4, BK=32), dict(NW=4, RW=2, NQ=8, BK=32), dict(NW=4, RW=2, NQ=8, BK=32)]
    for c, txt, pat in ((consts[0], fwd_cu, r"constexpr int NW = (\d+), R = (\d+), BK = (\d+), DP = D \+ 1"),
                        (consts[1], bwd_cu, r"constexpr int NW = (\d+), RW = (\d+), NQ = NW \* RW, BK = (\d+), DP = D \+ 1, PER"),
                        (consts[2], bwd_cu, r"constexpr int NW = (\d+), RW = (\d+), NQ = NW \* RW, BK = (\d+), DP = D \+ 1, DL")):
        m = re.search(pat, txt)
        if not m:
            err(f"cp_core_smem: cannot read the constexprs ({pat})")
            continue
        a, b, bk = map(int, m.groups())
        c.update(NW=a, BK=bk, **({"R": b} if "R" in c else {"RW": b, "NQ": a * b}))
    rust = {k: (int(a), int(b)) for k, a, b in re.findall(r"Core::(\w+) => (\d+) \* d \+ (\d+),", core_rs)}
    kinds = ("Fwd", "Dkdv", "Dq")
    table = {}
    for kind, expr, c in zip(kinds, ns, consts):
        if kind not in rust:
            err(f"core.rs smem_bytes: no `Core::{kind} => a * d + b` arm")
            continue
        for d in (16, 32, 64, 96, 128, 256):
            floats = eval(expr, {}, dict(c, D=d, DP=d + 1))  # the kernel's N (integer arithmetic)
            want = rust[kind][0] * d + rust[kind][1]
            if floats != want:
                err(f"cp_core_smem<{expr}> at d {d}: {floats} floats, core.rs Core::{kind} says {want}")
            table.setdefault(kind, {})[d] = 0 if floats * 4 <= (lim or 48) * 1024 else floats * 4
    return lambda kind, d: table.get(kind, {}).get(d, 0)


def tile_configs():
    """Tile constants on both sides (kernel .cu vs Rust launcher), asserted equal; returns the
    launch shape per kernel family and head dim: {family: {d: (threads, rows per block, smem)}}.
    The shared-memory formulas below transcribe the kernels' pointer layouts (reviewed by hand
    against flash_fwd.cu fwd_pipe, flash_bwd_pipe.cu bwd_pipe_dkdv/dq, flash_bwd_fused.cu,
    flash_fwd_sm90.cu WGMMA_SMEM) and the Rust formulas (flash.rs pipe_config, bwd_pipe.rs
    PipeCfg::smem, bwd_fused.rs smem, sm90.rs wgmma_smem); the parameters are read from source."""
    out = {}
    fwd_cu, fwd_rs = rd("kernels", "flash_fwd.cu"), rd("src", "flash.rs")
    def pipe_list(macro, entry):
        """{d: (NW, MT, BK)} of the `entry(NAME, D, NW, MT, BK)` list `#define macro(NAME)`."""
        m = re.search(r"#define " + macro + r"\(NAME\)((?:.*\\\n)*.*)", fwd_cu)
        return {int(d): (int(nw), int(mt), int(bk)) for d, nw, mt, bk in
                re.findall(entry + r"\(NAME,\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\)", m.group(1) if m else "")}
    cu = pipe_list("PIPES", "PIPE")
    # flash.rs: pipe_tile(d) gives (NW, MT, BK) (one head dim special-cased), pipe_config the
    # launch from it: rows 16 NW MT, threads 32 NW, smem (BQ + 4 BK) (d + 8) 2 + BQ 4 (d = 256: the
    # per-row key bounds in the Q rows' padding, CpPadInts, no ints: pipe_pads_bounds).
    pt = re.search(r"fn pipe_tile\(d: usize\)[^{]*\{(.*?)\n\}", fwd_rs, re.S)
    tiles = num(r"if d == (\d+) \{\s*\((\d+), (\d+), (\d+)\)\s*\} else \{\s*\((\d+), (\d+), (\d+)\)\s*\}",
                pt.group(1) if pt else "", "flash.rs pipe_tile")
    pc = re.search(r"fn pipe_config\(d: usize\)[^{]*\{(.*?)\n\}", fwd_rs, re.S)
    formula = ("let bq = 16 * nw * mt;", "let ints = if pipe_pads_bounds(d) { 0 } else { bq * 4 };",
               "(bq, 32 * nw as u32, ((bq + 4 * bk) * (d + 8) * 2 + ints) as u32)")
    if not pc or any(f not in pc.group(1) for f in formula):
        err(f"flash.rs pipe_config: expected {formula} (the kernel's layout: Q, two K and two V buffers, BQ ints)")
    pads = [int(x) for x in re.findall(r"if constexpr \(D == (\d+)\) return CpPadInts<DP \* 2>\{fwd_pipe_smem \+ D \* 2(?: \+ 4)?\};", fwd_cu)]
    rpads = num(r"fn pipe_pads_bounds\(d: usize\) -> bool \{\s*d == (\d+)\s*\}", fwd_rs, "flash.rs pipe_pads_bounds")
    if len(pads) != 2 or len(set(pads)) != 1 or pads[0] != rpads:
        err(f"fwd_pipe keeps lim_s / lo_s in the Q rows' padding at D in {pads}, flash.rs pipe_pads_bounds says d == {rpads}")
    pad_d = rpads

    def rust_tile(d):
        if not tiles:
            return None
        return tuple(tiles[1:4]) if d == tiles[0] else tuple(tiles[4:7])
    def pipe_shape(d, nw, mt, bk):
        """(threads, rows, smem) of a forward pipe entry: Q, two K and two V buffers, BQ ints."""
        bq = nw * mt * 16
        return (nw * 32, bq, (bq + 4 * bk) * (d + 8) * 2 + (0 if d == pad_d else bq * 4))
    fam = out.setdefault("flash_fwd_pipe", {})
    for d, (nw, mt, bk) in sorted(cu.items()):
        if rust_tile(d) not in (None, (nw, mt, bk)):
            err(f"flash_fwd_pipe d{d}: kernel NW={nw} MT={mt} BK={bk} but flash.rs pipe_tile({d}) = {rust_tile(d)}")
        fam[d] = pipe_shape(d, nw, mt, bk)
    if sorted(cu) != [16, 32, 64, 96, 128, 256]:
        err(f"flash_fwd.cu PIPES: head dims {sorted(cu)}")
    # the soft-capped entries (flash_fwd_pipe_cap{,_band}_*, PIPES_CAP): PIPES' tiles except the
    # head dim flash.rs pipe_tile_of special-cases (d128 over 32-key tiles); pipe_config_of takes
    # the K / V rows of the smaller tiles off pipe_config's bytes
    cu_cap = pipe_list("PIPES_CAP", "PIPE_CAP")
    ptc = re.search(r"fn pipe_tile_of\(d: usize, capped: bool\)[^{]*\{(.*?)\n\}", fwd_rs, re.S)
    ctile = num(r"if capped && d == (\d+) \{\s*\((\d+), (\d+), (\d+)\)\s*\} else \{\s*pipe_tile\(d\)\s*\}",
                ptc.group(1) if ptc else "", "flash.rs pipe_tile_of")
    if "(rows, threads, smem - (4 * (bk - cbk) * (d + 8) * 2) as u32)" not in fwd_rs:
        err("flash.rs pipe_config_of: expected pipe_config's bytes less 4 (bk - cbk) rows of (d + 8) 16-bit elements")
    fam = out.setdefault("flash_fwd_pipe_cap", {})
    for d, (nw, mt, bk) in sorted(cu_cap.items()):
        want = tuple(ctile[1:4]) if ctile and d == ctile[0] else rust_tile(d)
        if want not in (None, (nw, mt, bk)):
            err(f"flash_fwd_pipe_cap d{d}: kernel NW={nw} MT={mt} BK={bk} but flash.rs pipe_tile_of({d}, true) = {want}")
        fam[d] = pipe_shape(d, nw, mt, bk)
    if sorted(cu_cap) != [16, 32, 64, 96, 128, 256]:
        err(f"flash_fwd.cu PIPES_CAP: head dims {sorted(cu_cap)}")

    # flash_bwd_pipe.cu PipeCfg<D> (generic, KV_DA = D) and its specializations vs bwd_pipe.rs
    # PipeCfg::of (`if d == N { Self { .. } }` branches, `else` = generic with kv_da: d).
    bp_cu, bp_rs = rd("kernels", "flash_bwd_pipe.cu"), rd("src", "flash", "bwd_pipe.rs")
    keys = ("KV_NW", "KV_BQ", "KV_DA", "Q_NW", "Q_MT", "Q_BN")
    rk = tuple(k.lower() for k in keys)

    def fields(text, sep):
        return {k: v for k, v in re.findall(r"(\w+)" + sep + r"(\w+)", text)}
    cu_cfg = {}
    for m in re.finditer(r"template <(?:int D)?> struct PipeCfg(?:<(\d+)>)? \{\s*static constexpr int ([^;]*);", bp_cu):
        cu_cfg[int(m.group(1)) if m.group(1) else "D"] = fields(m.group(2), r" = ")
    rs_cfg = {}
    of = re.search(r"pub\(super\) fn of\(d: usize\) -> Self \{(.*?)\n    \}", bp_rs, re.S)
    for m in re.finditer(r"(?:if d == (\d+)|else) \{\s*Self \{ ([^}]*)\}", of.group(1) if of else ""):
        rs_cfg[int(m.group(1)) if m.group(1) else "D"] = fields(m.group(2), r": ")
    if set(cu_cfg) != set(rs_cfg) or "D" not in cu_cfg:
        err(f"PipeCfg specializations: flash_bwd_pipe.cu {sorted(map(str, cu_cfg))} != bwd_pipe.rs PipeCfg::of {sorted(map(str, rs_cfg))}")
    for spec in cu_cfg:
        c, r = cu_cfg[spec], rs_cfg.get(spec, {})
        cv, rv = [c.get(k) for k in keys], [r.get(k) for k in rk]
        if [str(x).replace("d", "D") for x in rv] != [str(x) for x in cv]:
            err(f"PipeCfg<{spec}> {dict(zip(keys, cv))} != bwd_pipe.rs PipeCfg::of {dict(zip(rk, rv))}")
    if "hkv * (d / self.kv_da)" not in bp_rs:
        err("bwd_pipe.rs kv_grid_x: expected hkv * (d / self.kv_da) (the kernel's kvh = blockIdx.x / (D / DA))")
    for d in (16, 32, 64, 96, 128, 256):
        c = cu_cfg.get(d) or cu_cfg.get("D") or {}
        try:
            kv_nw, kv_bq, _, q_nw, q_mt, q_bn = [int(c[k]) if c[k] != "D" else d for k in keys]
        except (KeyError, ValueError):
            err(f"PipeCfg<{d}>: cannot read {keys} from {c}")
            continue
        row = (d + 8) * 2
        out.setdefault("flash_bwd_pipe_dkdv", {})[d] = (32 * kv_nw, 16 * kv_nw, (2 * 16 * kv_nw + 4 * kv_bq) * row + 4 * kv_bq * 4)
        out.setdefault("flash_bwd_pipe_dq", {})[d] = (32 * q_nw, 16 * q_mt * q_nw, (2 * 16 * q_mt * q_nw + 4 * q_bn) * row)

    fu_cu, fu_rs = rd("kernels", "flash_bwd_fused.cu"), rd("src", "flash", "bwd_fused.rs")
    cnw, cbq = num(r"template <int D> struct FusedCfg \{\s*static constexpr int NW = (\d+), BQ = (\d+);", fu_cu, "FusedCfg<D>") or (0, 0)
    if re.search(r"struct FusedCfg<\d+>", fu_cu):
        err("flash_bwd_fused.cu: FusedCfg has a specialization; teach check_launch_args.py about it")
    rnw, rbq = num(r"const NW: usize = (\d+);", fu_rs, "bwd_fused.rs NW"), num(r"const BQ: usize = (\d+);", fu_rs, "bwd_fused.rs BQ")
    if (cnw, cbq) != (rnw, rbq):
        err(f"FusedCfg NW={cnw} BQ={cbq} != bwd_fused.rs NW={rnw} BQ={rbq}")
    for d in (16, 32, 64, 128):
        bn = 16 * cnw
        out.setdefault("flash_bwd_fused", {})[d] = (32 * cnw, bn, (2 * bn + 4 * cbq) * (d + 8) * 2 + bn * (cbq + 8) * 2 + 4 * cbq * 4)

    wg_cu, wg_rs = rd("kernels", "flash_fwd_sm90.cu"), rd("src", "flash", "sm90.rs")
    cbq_, cbk_ = num(r"#define WGMMA_BQ (\d+)", wg_cu, "WGMMA_BQ"), num(r"#define WGMMA_BK (\d+)", wg_cu, "WGMMA_BK")
    nwg = num(r"constexpr int NWG = (\d+), NTH = 128 \* NWG, BQ = 64 \* NWG", wg_cu, "fwd_wgmma NWG")
    rbq_, rbk_ = num(r"const WGMMA_BQ: usize = (\d+);", wg_rs, "sm90.rs WGMMA_BQ"), num(r"const WGMMA_BK: usize = (\d+);", wg_rs, "sm90.rs WGMMA_BK")
    rthr = num(r"const WGMMA_THREADS: u32 = (\d+);", wg_rs, "sm90.rs WGMMA_THREADS")
    if nwg and (64 * nwg != cbq_ or 128 * nwg != rthr or (cbq_, cbk_) != (rbq_, rbk_)):
        err(f"wgmma: kernel NWG={nwg} (BQ {64 * nwg}, {128 * nwg} threads), WGMMA_BQ={cbq_} BK={cbk_}; sm90.rs BQ={rbq_} BK={rbk_} threads={rthr}")
    for d in (64, 128):
        out.setdefault("flash_fwd_wgmma", {})[d] = (rthr, cbq_, (cbq_ + 4 * cbk_) * d * 2 + 1024)

    # wgmma backward (flash_bwd_sm90.cu, bwd_sm90.rs) and warp-specialized forward
    # (flash_fwd_sm90_ws.cu, sm90_ws.rs): emu/check_launch_sm90.py
    wgmma_bwd_configs(rd, num, err, out)
    wgmma_ws_configs(rd, num, err, out)
    wgmma_ws_bwd_configs(rd, num, err, out)  # flash_bwd_sm90_ws.cu, bwd_sm90_ws.rs

    # CUDA-core and mma kernels (static shared memory only): block threads and rows (keys) per block.
    bwd_cu, mma_cu = rd("kernels", "flash_bwd.cu"), rd("kernels", "flash_bwd_mma.cu")
    nw, r = num(r"constexpr int NW = (\d+), R = (\d+), BK = \d+, DP = D \+ 1", fwd_cu, "fwd_simple NW, R") or (0, 0)
    mbq = num(r"constexpr int BQ = (\d+), BK = \d+, DP = D \+ 8, KP", fwd_cu, "fwd_mma BQ")
    rs = num(r'FwdKernel::Simple => \("simple", (\d+), (\d+), core::core_smem\(core::Core::Fwd, d\)\)', fwd_rs,
             "flash.rs simple (rows, threads, core_smem(Fwd, d))")
    core_smem = core_smem_configs(fwd_cu, rd("kernels", "flash_bwd.cu"), rd("src", "flash", "core.rs"), num, err)
    rm = num(r'FwdKernel::Mma => \("mma", (\d+), (\d+), 0\)', fwd_rs, "flash.rs mma (rows, threads, 0)")
    if rs and rs != [nw * r, nw * 32]:
        err(f"fwd_simple: kernel NW={nw} R={r} ({nw * r} rows, {nw * 32} threads) != flash.rs (rows, threads) {rs}")
    if rm and mbq and rm != [mbq, mbq // 16 * 32]:
        err(f"fwd_mma: kernel BQ={mbq} ({mbq // 16 * 32} threads: one warp per 16 rows) != flash.rs (rows, threads) {rm}")
    kv = num(r"constexpr int NW = (\d+), RW = \d+, NQ = NW \* RW, BK = (\d+), DP = D \+ 1, PER", bwd_cu, "bwd_dkdv NW, BK") or (0, 0)
    dq = num(r"constexpr int NW = (\d+), RW = (\d+), NQ = NW \* RW, BK = \d+, DP = D \+ 1, DL", bwd_cu, "bwd_dq NW, RW") or (0, 0)
    mkv = num(r"constexpr int BK = (\d+), BQ = \d+, DP = D \+ 8", mma_cu, "bwd_mma_dkdv BK")
    mdq = num(r"constexpr int BQ = (\d+), BK = \d+, DP = D \+ 8", mma_cu, "bwd_mma_dq BQ")
    bwd_rs = rd("src", "flash", "bwd.rs")  # the CUDA-core / mma backward launches
    thr = num(r"let threads = if use_mma \{ (\d+) \} else \{ (\d+) \};", bwd_rs, "flash/bwd.rs bwd dkdv threads")
    keys = num(r"grid_dim: \(s\.div_ceil\((\d+)\) as u32, hkv as u32", bwd_rs, "flash/bwd.rs bwd dkdv keys per block")
    rows = num(r"let rows = if use_mma \{ (\d+) \} else \{ (\d+) \};", bwd_rs, "flash/bwd.rs bwd dq rows")
    dthr = num(r"grid_dim: \(t\.div_ceil\(rows\) as u32, h as u32, b as u32\), block_dim: \((\d+), 1, 1\)", bwd_rs, "flash/bwd.rs bwd dq threads")
    if keys is not None and (keys != kv[1] or keys != mkv):
        err(f"bwd dkdv keys per block: flash/bwd.rs {keys}, flash_bwd.cu BK={kv[1]}, flash_bwd_mma.cu BK={mkv}")
    if rows and (rows[1] != dq[0] * dq[1] or rows[0] != mdq):
        err(f"bwd dq rows per block: flash/bwd.rs (mma, simple) {rows}, flash_bwd_mma.cu BQ={mdq}, flash_bwd.cu NW*RW={dq[0] * dq[1]}")
    if thr and thr[1] != kv[0] * 32:
        err(f"bwd simple dkdv: flash/bwd.rs threads {thr[1]} != flash_bwd.cu NW*32 = {kv[0] * 32}")
    if dthr is not None and mdq and (dthr != dq[0] * 32 or dthr != mdq // 16 * 32):
        err(f"bwd dq: flash/bwd.rs threads {dthr}, flash_bwd.cu NW*32 = {dq[0] * 32}, flash_bwd_mma.cu BQ/16*32 = {mdq // 16 * 32}")
    for d in (16, 32, 64, 96, 128):  # (the mma kernels also take 96, not 256)
        out.setdefault("flash_fwd_mma", {})[d] = (rm[1] if rm else 0, mbq, 0)
        out.setdefault("flash_bwd_mma_dkdv", {})[d] = (thr[0] if thr else 0, keys, 0)
        out.setdefault("flash_bwd_mma_dq", {})[d] = (dthr, rows[0] if rows else 0, 0)
    for d in (16, 32, 64, 96, 128, 256):  # the CUDA-core kernels also take 96 and 256 (dynamic shared memory at 256)
        out.setdefault("flash_fwd_simple", {})[d] = (rs[1] if rs else 0, nw * r, core_smem("Fwd", d))
        out.setdefault("flash_bwd_dkdv", {})[d] = (thr[1] if thr else 0, keys, core_smem("Dkdv", d))
        out.setdefault("flash_bwd_dq", {})[d] = (dthr, rows[1] if rows else 0, core_smem("Dq", d))
    for f in ("flash/bwd.rs", "flash/band.rs"):
        src = rd("src", *f.split("/"))
        for kind in ("Dkdv", "Dq"):
            if f"core_smem(Core::{kind}, d)" not in src:
                err(f"{f}: the CUDA-core {kind} launch does not size its shared memory with core::core_smem(Core::{kind}, d)")
    # band entries (`*_band_*`, launched from src/flash/band.rs): the launch shapes of their
    # non-band kernels (the forward pipe adds BQ ints, lo_s, except where both bounds live in the
    # Q rows' padding: pipe_band_smem)
    band_rs = rd("src", "flash", "band.rs")
    if "smem + if pipe_pads_bounds(d) { 0 } else { rows as u32 * 4 }" not in band_rs:
        err("band.rs pipe_band_smem: expected the non-band smem plus 4 bytes per row (lo_s in fwd_pipe) unless pipe_pads_bounds")
    for fam in ("flash_fwd_simple", "flash_fwd_pipe", "flash_fwd_pipe_cap", "flash_bwd_dkdv", "flash_bwd_dq", "flash_bwd_pipe_dkdv", "flash_bwd_pipe_dq"):
        fwd_pipe = fam in ("flash_fwd_pipe", "flash_fwd_pipe_cap")
        out[fam + "_band"] = {d: (c[0], c[1], c[2] + (c[1] * 4 if fwd_pipe and d != pad_d else 0)) for d, c in out[fam].items()}
    # the pipelined backward's soft-capped entries (flash_bwd_pipe_cap_*) launch as the uncapped ones
    for fam in ("flash_bwd_pipe_dkdv", "flash_bwd_pipe_dq", "flash_bwd_pipe_dkdv_band", "flash_bwd_pipe_dq_band"):
        out[fam.replace("flash_bwd_pipe", "flash_bwd_pipe_cap", 1)] = dict(out[fam])
    # the warp-specialized kernels' band entries launch as the non-band ones (sm90_ws.rs ws_config,
    # bwd_sm90_ws.rs: one LaunchConfig for both)
    out["flash_fwd_wgmma_ws_band"] = dict(out.get("flash_fwd_wgmma_ws", {}))
    # their TMA entries too (sm90_ws.rs fwd_wgmma_tma / fwd_tma_band: ws_config)
    out["flash_fwd_wgmma_tma"] = dict(out.get("flash_fwd_wgmma_ws", {}))
    out["flash_fwd_wgmma_tma_band"] = dict(out.get("flash_fwd_wgmma_ws", {}))
    out["flash_bwd_wgmma_tma_band"] = dict(out.get("flash_bwd_wgmma_tma", {}))  # (wgmma_ws_bwd_configs)
    out["flash_bwd_wgmma_ws_band"] = dict(out.get("flash_bwd_wgmma_ws", {}))
    for fam in ("flash_fwd_wgmma", "flash_bwd_wgmma_dkdv", "flash_bwd_wgmma_atomic", "flash_bwd_wgmma_dq"):
        out[fam + "_band"] = dict(out.get(fam, {}))
    return out


def fixed_blocks():
    """Entries launched with one block size whatever their shapes ({name regex: threads}): the
    grouped products (grouped_gemm.rs THREADS, which must equal grouped_gemm.cu GG_THREADS)."""
    with open(os.path.join(SRC, "grouped_gemm.rs")) as f:
        rs = re.search(r"const THREADS: u32 = (\d+);", f.read())
    with open(os.path.join(KERN, "grouped_gemm.cu")) as f:
        cu = re.search(r"constexpr int GG_THREADS = (\d+);", f.read())
    if not rs or not cu:
        err("grouped_gemm: THREADS (src/grouped_gemm.rs) or GG_THREADS (kernels/grouped_gemm.cu) not found")
        return {}
    if int(rs.group(1)) != int(cu.group(1)):
        err(f"grouped_gemm: launcher THREADS {rs.group(1)} != kernel GG_THREADS {cu.group(1)}")
    return {r"^grouped_gemm_(nt|nn|tn)_(f32|f16|bf16)$": int(rs.group(1))}


def main():
    ptx_dir = None
    if "--ptx-dir" in sys.argv:
        ptx_dir = sys.argv[sys.argv.index("--ptx-dir") + 1]
    cents, launched, nchecks = check()
    unlaunched = sorted(set(cents) - launched)
    nptx = nbounds = 0
    cfgs = tile_configs()
    fixed = fixed_blocks()
    if ptx_dir:
        pents, files = ptx_entries(ptx_dir)
        if len(files) < 10:
            err(f"expected 10 PTX files under {ptx_dir}, found {len(files)}")
        for name, (cfile, cps) in cents.items():
            if name not in pents:
                err(f"{name} ({cfile}): no .entry in the PTX under {ptx_dir}")
                continue
            pfile, widths, maxnt = pents[name]
            cw = [c_width(p) for p in cps]
            if widths != cw:
                err(f"{name}: PTX {pfile} param widths {widths} != C widths {cw}")
            nptx += 1
            fam = re.match(r"^(\w+?)_(?:f32|f16|bf16)_d(\d+)$", name)
            fb = next((t for pat, t in fixed.items() if re.match(pat, name)), None)
            if maxnt is not None and fb is not None:
                if fb != maxnt:
                    err(f"{name}: launcher block {fb} threads != __launch_bounds__ {maxnt}")
                else:
                    nbounds += 1
            elif maxnt is not None:
                cfg = cfgs.get(fam.group(1), {}).get(int(fam.group(2))) if fam else None
                if cfg is None:
                    err(f"{name}: has __launch_bounds__ ({maxnt}) but no launch shape in tile_configs()")
                elif cfg[0] != maxnt:
                    err(f"{name}: launcher block {cfg[0]} threads != __launch_bounds__ {maxnt}")
                else:
                    nbounds += 1
    for e in errors:
        print("check_launch_args:", e)
    if errors:
        print(f"check_launch_args: FAILED ({len(errors)} problems)")
        return 1
    print(f"check_launch_args: OK ({nchecks} launches of {len(launched)}/{len(cents)} entries match their "
          f"C signatures{f', {nptx} PTX param lists, {nbounds} launch bounds' if ptx_dir else ''}; tile configs and shared-memory sizes in sync; "
          f"not launched from Rust: {', '.join(unlaunched) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
