//! Harness for end-to-end tests: starts the real binaries, waits for them
//! with deadlines (never a bare sleep), and reaps every child it started.
//! Binaries come from the same target directory as the test executable;
//! `cargo test --workspace` (or `cargo build --workspace`) builds them.

pub mod cluster;
pub mod fleet;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Root of the workspace.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Path of a workspace binary (or `libkvclient.so`) next to the running test;
/// a name with a `/` is a path used as it is (another release's binary).
pub fn bin(name: &str) -> PathBuf {
    if name.contains('/') {
        return PathBuf::from(name);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // A test runs from target/PROFILE/deps, kv-local from target/PROFILE.
    let dir = exe.parent().map(|d| if d.ends_with("deps") { d.parent().unwrap_or(d) } else { d }).expect("target dir");
    let p = dir.join(name);
    assert!(p.exists(), "{} not built: run `cargo build --workspace` first", p.display());
    // `cargo test -p kv-e2e` does not rebuild other packages' binaries: refuse
    // to test a binary older than the sources it is built from.
    let built = std::fs::metadata(&p).and_then(|m| m.modified()).expect("binary mtime");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    // The crates each binary is built from (dependency order, docs/ARCHITECTURE.md "Parts").
    let sources: &[&str] = match name {
        "kv-server" => &["common", "server"],
        "kvctl" => &["common", "client-ffi", "ctl"],
        "kv-mds" => &["common", "mds"],
        "libkvclient.so" => &["common", "client-ffi"],
        _ => &[],
    };
    for crate_dir in sources {
        if let Some(newer) = newest_source(&root.join(crate_dir).join("src")).filter(|(t, _)| *t > built) {
            panic!("{} is older than {}: run `cargo build --workspace` first", p.display(), newer.1.display());
        }
    }
    p
}

fn newest_source(dir: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let path = e.path();
        let found = if path.is_dir() {
            newest_source(&path)
        } else {
            e.metadata().and_then(|m| m.modified()).ok().map(|t| (t, path))
        };
        if let Some(f) = found {
            if newest.as_ref().is_none_or(|n| f.0 > n.0) {
                newest = Some(f);
            }
        }
    }
    newest
}

/// A running `kv-server`.
pub struct Node {
    child: Option<Child>,
    pub addr: String,
    pub stderr_lines: mpsc::Receiver<String>,
}

impl Node {
    /// Starts `kv-server --listen 127.0.0.1:0 ARGS...` and waits (up to 30 s)
    /// for the line announcing its address.
    pub fn start(args: &[&str]) -> Node {
        Node::start_at("127.0.0.1:0", args)
    }

    /// As [`Node::start`] on a given `--listen` address.
    pub fn start_at(listen: &str, args: &[&str]) -> Node {
        Node::start_bin("kv-server", listen, args)
    }

    /// As [`Node::start_at`] with another `kv-server` binary (a path).
    pub fn start_bin(binary: &str, listen: &str, args: &[&str]) -> Node {
        let mut full = vec!["--listen", listen];
        full.extend_from_slice(args);
        // Tests stop nodes often: no drain unless a test asks for one (the
        // previous release's binary has no such flag).
        if binary == "kv-server" && !args.contains(&"--drain-secs") {
            full.extend_from_slice(&["--drain-secs", "0"]);
        }
        let (child, addr, stderr_lines) = spawn_daemon(binary, &full, "kv-server listening on ");
        Node { child: Some(child), addr, stderr_lines }
    }

    /// `binary` (a workspace name or a path) with `args` (its `--listen`
    /// among them, else 127.0.0.1:0), `env` in its environment and its
    /// stderr appended to `log` (its `stderr_lines` then stay empty).
    pub fn start_logged(binary: &str, args: &[&str], env: &[(String, String)], log: &Path) -> Node {
        let mut full: Vec<&str> = Vec::new();
        if !args.contains(&"--listen") {
            full.extend_from_slice(&["--listen", "127.0.0.1:0"]);
        }
        full.extend_from_slice(args);
        let spawned = try_spawn_daemon_with(binary, &full, "kv-server listening on ", env, Some(log));
        let (child, addr, stderr_lines) = spawned.unwrap_or_else(|e| panic!("{e}"));
        Node { child: Some(child), addr, stderr_lines }
    }

    /// A node of `binary` (a workspace name or a path) on `listen` that
    /// joins `group` as `id` through the kv-mds replicas `eps`, advertising
    /// the port it listens on, with `dirs` (64 MiB each unless `extra` says
    /// otherwise) and `extra` flags.
    pub fn member(binary: &str, listen: &str, dirs: &str, eps: &str, group: &str, id: &str, extra: &[&str]) -> Node {
        let mut args = vec!["--dir", dirs, "--mds", eps, "--group", group, "--id", id, "--advertise", "127.0.0.1:0"];
        if !extra.contains(&"--cap") {
            args.extend_from_slice(&["--cap", "64M"]);
        }
        args.extend_from_slice(extra);
        Node::start_bin(binary, listen, &args)
    }

    /// `n` nodes, each with one disk dir `t/n{i}` (64 MiB cap) and `extra` flags.
    pub fn cluster(t: &tempfile::TempDir, n: usize, extra: &[&str]) -> Vec<Node> {
        (0..n)
            .map(|i| {
                let d = t.path().join(format!("n{i}"));
                let mut args = vec!["--dir", d.to_str().expect("utf-8 path"), "--cap", "64M", "--log-level", "warn"];
                args.extend_from_slice(extra);
                Node::start(&args)
            })
            .collect()
    }

    /// `n{i}=ADDR,...` for a set of nodes.
    pub fn members(nodes: &[Node]) -> String {
        nodes.iter().enumerate().map(|(i, n)| format!("n{i}={}", n.addr)).collect::<Vec<_>>().join(",")
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    /// Sends a signal to this node (only to the process we started).
    /// Sends `sig`; after SIGSTOP, returns once the process has stopped
    /// (kill(2) returns before the target's threads are all halted).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(self.pid(), sig) };
        if sig == libc::SIGSTOP {
            let stat = format!("/proc/{}/stat", self.pid());
            let stopped = || {
                std::fs::read_to_string(&stat)
                    .ok()
                    .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
                    .unwrap_or(true)
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !stopped() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits up to `limit` for the node to exit by itself (after a drain).
    pub fn wait_exit(mut self, limit: Duration) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        wait_deadline(&mut c, limit)
    }

    /// As [`Node::wait_exit`], with every line the node wrote to stderr
    /// (those not yet taken from `stderr_lines`).
    pub fn wait_exit_lines(mut self, limit: Duration) -> (ExitStatus, Vec<String>) {
        let mut c = self.child.take().expect("running");
        let status = wait_deadline(&mut c, limit);
        // The reader thread ends with the pipe: the last lines arrive
        // shortly after the exit.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut lines = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.stderr_lines.recv_timeout(left) {
                Ok(l) => lines.push(l),
                Err(_) => break,
            }
        }
        (status, lines)
    }

    /// SIGTERM, then wait up to `limit` for the exit status.
    pub fn terminate(mut self, limit: Duration) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let mut c = self.child.take().expect("running");
        wait_deadline(&mut c, limit)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a daemon and waits (up to 30 s) for the stdout line
/// `announce` + address; returns the child, that address and its stderr
/// lines. Panics with the daemon's stderr if it does not come up.
pub fn spawn_daemon(name: &str, args: &[&str], announce: &str) -> (Child, String, mpsc::Receiver<String>) {
    try_spawn_daemon(name, args, announce).unwrap_or_else(|e| panic!("{e}"))
}

/// As [`spawn_daemon`], with the failure (and the daemon's stderr) as an error.
pub fn try_spawn_daemon(
    name: &str,
    args: &[&str],
    announce: &str,
) -> Result<(Child, String, mpsc::Receiver<String>), String> {
    try_spawn_daemon_with(name, args, announce, &[], None)
}

/// As [`try_spawn_daemon`], with `env` added to the daemon's environment
/// and, given `log`, its stderr appended to that file instead of returned.
pub fn try_spawn_daemon_with(
    name: &str,
    args: &[&str],
    announce: &str,
    env: &[(String, String)],
    log: Option<&Path>,
) -> Result<(Child, String, mpsc::Receiver<String>), String> {
    let stderr_to = match log {
        Some(p) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("log {}: {e}", p.display()))?,
        ),
        None => Stdio::piped(),
    };
    let mut child = Command::new(bin(name))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr_to)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (etx, erx) = mpsc::channel();
    if let Some(stderr) = child.stderr.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = etx.send(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(a) = line.strip_prefix(announce) {
                    return Ok((child, a.trim().to_string(), erx));
                }
            }
            Err(_) => {
                let exited = child.try_wait().ok().flatten();
                let _ = child.kill();
                let _ = child.wait();
                // The stderr reader may still be draining the pipe.
                std::thread::sleep(Duration::from_millis(100));
                let lines: Vec<String> = match log {
                    Some(p) => std::fs::read_to_string(p).unwrap_or_default().lines().map(String::from).collect(),
                    None => erx.try_iter().collect(),
                };
                let what = match exited {
                    Some(st) => format!("{name} exited ({st}) before it listened"),
                    None => format!("{name} did not come up within 30 s"),
                };
                return Err(format!("{what}; stderr:\n{}", lines.join("\n")));
            }
        }
    }
}

/// Waits for a child to exit; kills it and panics after `limit`.
pub fn wait_deadline(c: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().expect("wait") {
            return st;
        }
        if Instant::now() >= deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!("process did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a binary to completion (30 s limit): (exit code, stdout, stderr).
pub fn run(name: &str, args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(bin(name))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let st = wait_deadline(&mut c, Duration::from_secs(30));
    let mut out = String::new();
    let mut err = String::new();
    use std::io::Read;
    if let Some(mut s) = c.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = c.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    (st.code().unwrap_or(-1), out, err)
}
