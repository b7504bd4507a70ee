//! Mismatch analysis for the probe kernels (`kernels/probe.cu`, `kernels/probe_sm90.cu`): given,
//! for every register (or 16-bit half) of every thread, the coordinates the code's reading of the
//! PTX ISA predicts and the coordinates the dump decodes to, says OK or which register holds which
//! element instead, and names the pattern when the mismatches follow one (rows 8..15 swapped with
//! 0..7, transposed, shifted k-step, ...). Plain Rust, compiled without the `cuda` feature so that
//! it is unit-tested on the CPU; the expected layouts and the probes' inputs are in
//! [`crate::probe_map`], the launches in `probe` (feature `cuda`).

use std::collections::BTreeMap;

/// Result of one probe: `name` (e.g. `mma16816 bf16`), `ok`, and a one-paragraph diagnosis
/// (`OK (...)` or the mismatches: count, pattern, first few registers).
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeResult {
    /// Probe name, e.g. `wgmma ss m64n128k16 bf16`.
    pub name: String,
    /// Whether every register held the predicted element.
    pub ok: bool,
    /// `OK (n registers checked)` or the mismatch report (see [`diagnose`]).
    pub diagnosis: String,
}

/// One register (or 16-bit half register) of one thread in a probe dump.
#[derive(Clone, Debug)]
pub struct Item {
    /// k-step (wgmma probes) or pass, named by `Check::step_name`; `None` when there is one.
    pub step: Option<u32>,
    /// Thread index in the block (lane for the one-warp probes).
    pub thread: u32,
    /// Register index (accumulator element, fragment register, chunk).
    pub reg: u32,
    /// Which 16-bit half (0 low, 1 high) for packed registers, `None` for 32-bit ones.
    pub half: Option<u8>,
    /// Coordinates the documented layout predicts, one per axis of the [`Check`].
    pub expected: Vec<i64>,
    /// Coordinates decoded from the dump, per axis; `Err(raw value)` when the value identifies no
    /// single source element (zero, a sum, poison).
    pub found: Vec<Result<i64, String>>,
}

impl Item {
    fn is_ok(&self) -> bool {
        self.expected.iter().zip(&self.found).all(|(e, f)| f.as_ref().ok() == Some(e))
    }
    fn loc(&self, step_name: &str, reg_name: &str) -> String {
        let mut s = String::new();
        if let Some(k) = self.step {
            s += &format!("{step_name} {k} ");
        }
        s += &format!("thread {} {reg_name}[{}]", self.thread, self.reg);
        if let Some(h) = self.half {
            s += if h == 0 { ".lo" } else { ".hi" };
        }
        s
    }
}

/// All registers of one probe: the axis names (e.g. `row`, `col`, `A k-step`, `B k`), how to
/// name a register (`d`, `r`, `chunk`), and the items.
#[derive(Clone, Debug)]
pub struct Check {
    /// Probe name.
    pub name: String,
    /// Axis names, in the order of `Item::expected` / `Item::found`.
    pub axes: Vec<&'static str>,
    /// Register name used in the report, e.g. `d` for accumulators.
    pub reg_name: &'static str,
    /// What `Item::step` counts (`kk`, `pass`).
    pub step_name: &'static str,
    /// One per register (half) of each thread.
    pub items: Vec<Item>,
}

fn tuple(axes: &[&str], v: &[String]) -> String {
    let parts: Vec<String> = axes.iter().zip(v).map(|(a, x)| format!("{a}={x}")).collect();
    format!("({})", parts.join(", "))
}

/// The relation that maps the expected value of axis `src` to the found value of axis `dst` on
/// every item of `its`, if any simple one does: equal, xor with a constant, plus a constant,
/// equal modulo 8 or 16, or any (listed) function.
fn relation(its: &[(&[i64], Vec<i64>)], src: usize, dst: usize, axes: &[&str]) -> Option<String> {
    let (s, d) = (axes[src], axes[dst]);
    let pairs: Vec<(i64, i64)> = its.iter().map(|(e, f)| (e[src], f[dst])).collect();
    if pairs.iter().all(|&(e, f)| e == f) {
        return Some(if src == dst { format!("{d} unchanged") } else { format!("{d} holds the expected {s}") });
    }
    if src != dst {
        for m in [16, 8] {
            if pairs.iter().all(|&(e, f)| e % m == f % m) {
                return Some(format!("{d} holds the expected {s} (mod {m})"));
            }
        }
        return None;
    }
    // xor / shift only when they explain at least 4 distinct values (else list the permutation)
    let distinct = pairs.iter().map(|p| p.0).collect::<std::collections::BTreeSet<i64>>().len();
    let x = pairs[0].0 ^ pairs[0].1;
    if distinct >= 4 && pairs.iter().all(|&(e, f)| e ^ f == x) {
        let extra = if x.count_ones() == 1 {
            format!(" ({d}s {x}..{} swapped with 0..{} in every group of {})", 2 * x - 1, x - 1, 2 * x)
        } else {
            String::new()
        };
        return Some(format!("{d} -> {d} ^ {x}{extra}"));
    }
    let c = pairs[0].1 - pairs[0].0;
    if distinct >= 4 && pairs.iter().all(|&(e, f)| f - e == c) {
        return Some(format!("{d} shifted by {c:+}"));
    }
    let mut map: BTreeMap<i64, i64> = BTreeMap::new();
    for &(e, f) in &pairs {
        if *map.entry(e).or_insert(f) != f {
            return None;
        }
    }
    let shown: Vec<String> = map.iter().take(8).map(|(e, f)| format!("{e}->{f}")).collect();
    Some(format!("{d} permuted: {}{}", shown.join(", "), if map.len() > 8 { ", ..." } else { "" }))
}

/// One-line pattern of the decodable mismatches: per axis that differs, the relation to the
/// expected coordinates (see `relation`), and a transposition of two axes when that explains it.
fn pattern(check: &Check, bad: &[&Item]) -> String {
    let dec: Vec<(&[i64], Vec<i64>)> = bad
        .iter()
        .filter_map(|it| it.found.iter().map(|f| f.as_ref().ok().copied()).collect::<Option<Vec<i64>>>().map(|f| (it.expected.as_slice(), f)))
        .collect();
    if dec.is_empty() {
        return String::new();
    }
    let n = check.axes.len();
    let differs = |j: usize| dec.iter().any(|(e, f)| e[j] != f[j]);
    // transposition of two axes (whole coordinates, or inside 8x8 / 16x16 blocks)
    for a in 0..n {
        for b in a + 1..n {
            if !(differs(a) && differs(b)) {
                continue;
            }
            for (m, what) in [(i64::MAX, ""), (16, " within 16x16 blocks"), (8, " within 8x8 blocks")] {
                let md = |x: i64| if m == i64::MAX { x } else { x.rem_euclid(m) };
                let others_same = (0..n).filter(|&j| j != a && j != b).all(|j| !differs(j));
                // (not when the two axes agree anyway, e.g. row and B k modulo 8)
                let distinct = dec.iter().any(|(e, _)| md(e[a]) != md(e[b]));
                if others_same && distinct && dec.iter().all(|(e, f)| md(f[a]) == md(e[b]) && md(f[b]) == md(e[a])) {
                    return format!("{} and {} transposed{what}", check.axes[a], check.axes[b]);
                }
            }
        }
    }
    let mut parts = Vec::new();
    for j in (0..n).filter(|&j| differs(j)) {
        // only the items where this axis is wrong
        let sub: Vec<(&[i64], Vec<i64>)> = dec.iter().filter(|(e, f)| e[j] != f[j]).cloned().collect();
        let rel = relation(&sub, j, j, &check.axes).or_else(|| (0..n).filter(|&i| i != j).find_map(|i| relation(&sub, i, j, &check.axes)));
        parts.push(match rel {
            Some(r) => format!("{r} ({} registers)", sub.len()),
            None => format!("{} wrong in {} registers, no simple pattern", check.axes[j], sub.len()),
        });
    }
    parts.join("; ")
}

/// OK or the mismatch report of `check`: `N of M <reg>s wrong; <pattern>; first: <loc>: expected
/// (axes) found (axes), ...` (at most 4 listed; undecodable values shown raw).
pub fn diagnose(check: &Check) -> ProbeResult {
    let bad: Vec<&Item> = check.items.iter().filter(|it| !it.is_ok()).collect();
    if bad.is_empty() {
        return ProbeResult { name: check.name.clone(), ok: true, diagnosis: format!("OK ({} values checked)", check.items.len()) };
    }
    let undecodable = bad.iter().filter(|it| it.found.iter().any(|f| f.is_err())).count();
    let mut s = format!("{} of {} values wrong", bad.len(), check.items.len());
    if undecodable > 0 {
        s += &format!(" ({undecodable} hold no single source element)");
    }
    let p = pattern(check, &bad);
    if !p.is_empty() {
        s += &format!("; pattern: {p}");
    }
    let first: Vec<String> = bad
        .iter()
        .take(4)
        .map(|it| {
            let e: Vec<String> = it.expected.iter().map(|x| x.to_string()).collect();
            let f: Vec<String> = it.found.iter().map(|x| match x {
                Ok(v) => v.to_string(),
                Err(raw) => format!("?{raw}"),
            }).collect();
            format!("{}: expected {} found {}", it.loc(check.step_name, check.reg_name), tuple(&check.axes, &e), tuple(&check.axes, &f))
        })
        .collect();
    s += &format!("; first: {}", first.join("; "));
    ProbeResult { name: check.name.clone(), ok: false, diagnosis: s }
}

/// One result from several checks of the same probe (e.g. the A-operand and B-operand passes):
/// OK when all are, else the failing checks' reports, each prefixed with `[check name]`.
pub fn diagnose_all(name: &str, checks: &[Check]) -> ProbeResult {
    let rs: Vec<ProbeResult> = checks.iter().map(diagnose).collect();
    if rs.iter().all(|r| r.ok) {
        let n: usize = checks.iter().map(|c| c.items.len()).sum();
        return ProbeResult { name: name.to_string(), ok: true, diagnosis: format!("OK ({n} values checked)") };
    }
    let parts: Vec<String> = rs.iter().filter(|r| !r.ok).map(|r| format!("[{}] {}", r.name, r.diagnosis)).collect();
    ProbeResult { name: name.to_string(), ok: false, diagnosis: parts.join(" | ") }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16 x 8 "register file": thread t, register r holds element (row, col) = (r, t).
    fn grid(f: impl Fn(i64, i64) -> (i64, i64)) -> Check {
        let mut items = Vec::new();
        for t in 0..8 {
            for r in 0..16 {
                let (fr, fc) = f(r, t);
                items.push(Item { step: None, thread: t as u32, reg: r as u32, half: None, expected: vec![r, t], found: vec![Ok(fr), Ok(fc)] });
            }
        }
        Check { name: "grid".into(), axes: vec!["row", "col"], reg_name: "d", step_name: "kk", items }
    }

    #[test]
    fn correct_dump_is_ok() {
        let r = diagnose(&grid(|r, c| (r, c)));
        assert!(r.ok, "{}", r.diagnosis);
        assert!(r.diagnosis.starts_with("OK (128 values"), "{}", r.diagnosis);
    }

    #[test]
    fn swapped_row_halves() {
        let r = diagnose(&grid(|r, c| (r ^ 8, c)));
        assert!(!r.ok);
        assert!(r.diagnosis.starts_with("128 of 128 values wrong"), "{}", r.diagnosis);
        assert!(r.diagnosis.contains("row -> row ^ 8 (rows 8..15 swapped with 0..7 in every group of 16)"), "{}", r.diagnosis);
        assert!(r.diagnosis.contains("thread 0 d[0]: expected (row=0, col=0) found (row=8, col=0)"), "{}", r.diagnosis);
    }

    #[test]
    fn two_rows_swapped() {
        let r = diagnose(&grid(|r, c| (if r == 3 { 5 } else if r == 5 { 3 } else { r }, c)));
        assert!(!r.ok);
        assert!(r.diagnosis.starts_with("16 of 128 values wrong"), "{}", r.diagnosis);
        assert!(r.diagnosis.contains("row permuted: 3->5, 5->3 (16 registers)"), "{}", r.diagnosis);
    }

    #[test]
    fn transposed_dump() {
        // square 8 x 8 so that a transpose stays in range
        let mut c = grid(|r, c| (c, r));
        c.items.retain(|it| it.expected[0] < 8);
        let r = diagnose(&c);
        assert!(!r.ok);
        assert!(r.diagnosis.contains("pattern: row and col transposed;"), "{}", r.diagnosis);
        let mut c = grid(|r, c| (8 * (r / 8) + c, 8 * (c / 8) + r % 8));
        c.items.retain(|it| it.expected[1] < 8);
        assert!(diagnose(&c).diagnosis.contains("transposed"), "{}", diagnose(&c).diagnosis);
    }

    #[test]
    fn shifted_and_undecodable() {
        let r = diagnose(&grid(|r, c| (r, c + 2)));
        assert!(r.diagnosis.contains("col shifted by +2 (128 registers)"), "{}", r.diagnosis);
        let mut c = grid(|r, c| (r, c));
        c.items[5].found[0] = Err("0".into());
        let r = diagnose(&c);
        assert!(!r.ok);
        assert!(r.diagnosis.starts_with("1 of 128 values wrong (1 hold no single source element)"), "{}", r.diagnosis);
        assert!(r.diagnosis.contains("found (row=?0, col=0)"), "{}", r.diagnosis);
    }
}
