//! A GRPO reward computed by an external command ([`command`]): a math checker, a unit-test
//! runner, a reward model served elsewhere — whatever reads text and prints a number.
//!
//! ```text
//! trainer ──{"prompt": "…", "completion": "…", "answer": "…"}\n──► command's stdin
//!         ◄──────────────────────────── 0.75\n ──────────────── command's stdout
//! ```
//!
//! One process for the whole run (started by [`command`], killed when the reward is dropped),
//! one JSON line per completion, one number per line back, in order; the texts are the token
//! ids decoded by the caller's [`Decode`] (the completion with its stop token when it
//! stopped). Every rank asks for the same completions: the answers are kept by query, so the
//! command scores each completion once however many ranks share the function (thread ranks),
//! and every rank gets the same number. An answer that is not a number, a command that exits
//! or answers nothing within the timeout, is an error naming the query — never a hang.

use super::grpo::RewardFn;
use candle_core::{bail, Result};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Token ids → text (a tokenizer's decode; byte-level: the bytes as UTF-8, lossy).
pub type Decode = Arc<dyn Fn(&[u32]) -> Result<String> + Send + Sync>;

/// A query: the prompt's, completion's and answer's ids.
type Query = (Vec<u32>, Vec<u32>, Vec<u32>);

/// The running command and the answers it gave.
struct Running {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<std::io::Result<String>>,
    timeout: Duration,
    answers: HashMap<Query, f64>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// The command's number for one query (asked once; later the kept one).
    fn score(&mut self, key: Query, line: String) -> Result<f64> {
        if let Some(&r) = self.answers.get(&key) {
            return Ok(r);
        }
        let name = self.name.clone();
        let e = |what: String| candle_core::Error::Msg(format!("reward command `{name}`: {what} (query {line})"));
        writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush()).map_err(|x| e(format!("writing its input: {x} (did it exit?)")))?;
        let answer = match self.lines.recv_timeout(self.timeout) {
            Ok(Ok(a)) => a,
            Ok(Err(x)) => return Err(e(format!("reading its output: {x}"))),
            Err(RecvTimeoutError::Timeout) => return Err(e(format!("no answer within {:?}", self.timeout))),
            Err(RecvTimeoutError::Disconnected) => return Err(e("it exited without answering".into())),
        };
        let r: f64 = answer.trim().parse().map_err(|_| e(format!("answered {answer:?}, not a number")))?;
        self.answers.insert(key, r);
        Ok(r)
    }
}

/// A reward computed by `program` with `args` (started now, its stderr the trainer's): each
/// completion sent as `{"prompt", "completion", "answer"}` texts (by `decode`) on one line of
/// its stdin, its reward read from one line of its stdout within `timeout`. Errors when the
/// program cannot be started (named).
pub fn command(program: &str, args: &[String], decode: Decode, timeout: Duration) -> Result<RewardFn> {
    let name = std::iter::once(program).chain(args.iter().map(String::as_str)).collect::<Vec<_>>().join(" ");
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| candle_core::Error::Msg(format!("reward command `{name}`: cannot start it: {e}")))?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        bail!("reward command `{name}`: no pipes to it")
    };
    // (its answers read by a thread of their own, so that a silent command times out)
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let running = Mutex::new(Running { name: name.clone(), child, stdin, lines, timeout, answers: HashMap::new() });
    Ok(Arc::new(move |prompt: &[u32], completion: &[u32], answer: &[u32]| {
        let query = serde_json::json!({"prompt": decode(prompt)?, "completion": decode(completion)?, "answer": decode(answer)?}).to_string();
        let mut r = running.lock().map_err(|_| candle_core::Error::Msg(format!("reward command `{name}`: a rank failed while asking it")))?;
        r.score((prompt.to_vec(), completion.to_vec(), answer.to_vec()), query)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes() -> Decode {
        Arc::new(|ids: &[u32]| Ok(ids.iter().map(|&t| t as u8 as char).collect()))
    }

    fn sh(script: &str) -> Result<RewardFn> {
        command("sh", &["-c".into(), script.into()], bytes(), Duration::from_secs(5))
    }

    /// A shell command scoring by the completion's length in the JSON line it reads: the
    /// queries are the decoded texts, the answers read back in order; a query asked again is
    /// answered from the kept ones (the command sees each once: here it counts its lines);
    /// a non-number, an exit, silence past the timeout and a missing program are errors
    /// naming what happened.
    #[test]
    fn a_command_scores_completions() -> Result<()> {
        // (its answer: the number of lines read so far, so a repeated query would show)
        let r = sh("n=0; while read line; do n=$((n+1)); case \"$line\" in *'\"completion\":\"AB\"'*) echo \"$n.5\";; *) echo $n;; esac; done")?;
        assert_eq!(r(&[112], &[65, 66], &[65])?, 1.5);
        assert_eq!(r(&[112], &[67], &[65])?, 2.0);
        assert_eq!(r(&[112], &[65, 66], &[65])?, 1.5, "asked again: kept");
        assert_eq!(r(&[112], &[68], &[65])?, 3.0);
        let bad = sh("read line; echo nope")?;
        assert!(bad(&[1], &[2], &[3]).unwrap_err().to_string().contains("answered \"nope\", not a number"));
        let gone = sh("exit 0")?;
        let e = gone(&[1], &[2], &[3]).unwrap_err().to_string();
        assert!(e.contains("exited") || e.contains("did it exit"), "{e}");
        let slow = command("sh", &["-c".into(), "read line; sleep 5".into()], bytes(), Duration::from_millis(200))?;
        assert!(slow(&[1], &[2], &[3]).unwrap_err().to_string().contains("no answer within"));
        let missing = command("/nonexistent/reward", &[], bytes(), Duration::from_secs(1));
        assert!(missing.err().is_some_and(|e| e.to_string().contains("cannot start it")));
        Ok(())
    }
}
