//! Shared helpers for the candle-cp examples.

/// Refuse a command line that names a flag the example does not take, so that a misspelt
/// flag (`--impl` for `--impls`, `--seq` for `--t`) is an error instead of a run with the
/// defaults. `args` is `std::env::args()` (program name first); `with_value` are the flags
/// followed by a value (skipped), `switches` the flags that stand alone. Tokens that are not
/// flags (values, plain words) are left to the example.
pub fn check_flags(args: &[String], with_value: &[&str], switches: &[&str]) -> anyhow::Result<()> {
    let mut i = 1;
    while i < args.len() {
        let a = args[i].as_str();
        if with_value.contains(&a) {
            if i + 1 >= args.len() {
                anyhow::bail!("{a} needs a value");
            }
            i += 2;
            continue;
        }
        if a.starts_with("--") && !switches.contains(&a) {
            let mut known: Vec<&str> = with_value.iter().chain(switches).copied().collect();
            known.sort_unstable();
            anyhow::bail!("unknown flag {a:?} (this example takes: {})", known.join(", "));
        }
        i += 1;
    }
    Ok(())
}

/// The value after flag `name` on the command line, parsed, or `default` when the flag is
/// absent; an error naming the flag when its value is missing or does not parse.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => match args.get(i + 1).map(|v| v.parse::<T>()) {
            Some(Ok(v)) => Ok(v),
            _ => anyhow::bail!("{name} needs a valid value"),
        },
        None => Ok(default),
    }
}

/// A field of `/proc/self/status` in kB (`"VmRSS:"`, `"VmHWM:"`); `None` where unavailable.
pub fn status_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::check_flags;

    fn args(s: &str) -> Vec<String> {
        std::iter::once("prog").chain(s.split_whitespace()).map(String::from).collect()
    }

    #[test]
    fn known_flags_pass_and_unknown_or_valueless_ones_fail() {
        let (v, s) = (&["--t", "--impls"][..], &["--quick"][..]);
        assert!(check_flags(&args(""), v, s).is_ok());
        assert!(check_flags(&args("--t 4096 --quick --impls a,b"), v, s).is_ok());
        // a value that looks like a flag is still the value
        assert!(check_flags(&args("--impls --quick"), v, s).is_ok());
        let e = check_flags(&args("--t 1 --impl a"), v, s).unwrap_err().to_string();
        assert!(e.contains("\"--impl\"") && e.contains("--impls, --quick, --t"), "{e}");
        let e = check_flags(&args("--quick --t"), v, s).unwrap_err().to_string();
        assert!(e.contains("--t needs a value"), "{e}");
    }
}
