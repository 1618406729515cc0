//! The membership tier for end-to-end tests: a real etcd (Debian's
//! etcd-server) on free loopback ports and real `kv-mds` replicas.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::spawn_daemon;

/// A port nobody listens on right now (the OS picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// Polls `f` every 20 ms until it returns Some, or panics with `what`
/// after `limit`.
/// A kept-alive HTTP connection to `addr` whose `GET /healthz` was answered
/// 200 (so the listener admitted it and it holds one of its slots), left
/// open. Panics with the answer when it is not a 200.
pub fn held_http_connection(addr: &str) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").expect("request");
    let mut seen = Vec::new();
    let mut b = [0u8; 1024];
    let body_from = loop {
        if let Some(i) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut b).expect("answer");
        assert!(n > 0, "closed before an answer: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&b[..n]);
    };
    let head = String::from_utf8_lossy(&seen[..body_from]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    while seen.len() < body_from + len {
        let n = s.read(&mut b).expect("body");
        assert!(n > 0, "closed inside the body");
        seen.extend_from_slice(&b[..n]);
    }
    s
}

pub fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The etcd binary: `etcd` on PATH (scripts/deps.sh installs etcd-server).
pub fn etcd_bin() -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':').chain(["/usr/bin", "/usr/local/bin"]) {
        let p = PathBuf::from(dir).join("etcd");
        if p.is_file() {
            return p;
        }
    }
    panic!("etcd not found: install Debian's etcd-server (scripts/deps.sh does)");
}

/// A single-member etcd on loopback, with its own data dir.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    tls: Option<EtcdTls>,
}

/// PEM files for an etcd that serves TLS and requires client certificates.
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl EtcdTls {
    /// Makes a CA, a server certificate for 127.0.0.1 and a client
    /// certificate (CN `client_cn`) with openssl, in `dir`.
    pub fn make(dir: &std::path::Path, client_cn: &str) -> EtcdTls {
        let p = |n: &str| dir.join(n);
        let ossl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("openssl (scripts/deps.sh installs it)");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        ossl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=kvcellar-test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        std::fs::write(
            p("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap();
        std::fs::write(p("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (name, cn) in [("server", "127.0.0.1"), ("client", client_cn)] {
            ossl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={cn}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ]);
            ossl(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
                "-out",
                &format!("{name}.pem"),
            ]);
        }
        EtcdTls {
            ca: p("ca.pem"),
            server_cert: p("server.pem"),
            server_key: p("server.key"),
            client_cert: p("client.pem"),
            client_key: p("client.key"),
        }
    }

    /// etcdctl's flags for these files.
    pub fn etcdctl_args(&self) -> Vec<String> {
        vec![
            format!("--cacert={}", self.ca.display()),
            format!("--cert={}", self.client_cert.display()),
            format!("--key={}", self.client_key.display()),
        ]
    }
}

impl Etcd {
    /// Starts etcd in `dir` on two free ports and waits until it is healthy.
    pub fn start(dir: PathBuf) -> Etcd {
        // A port found free can be taken before etcd binds it: try again.
        for _ in 0..3 {
            let mut e =
                Etcd { child: None, dir: dir.clone(), client_port: free_port(), peer_port: free_port(), tls: None };
            if e.spawn() {
                return e;
            }
        }
        panic!("etcd did not come up in three attempts");
    }

    /// As [`Etcd::start`], serving clients over TLS and requiring a client
    /// certificate signed by `tls.ca`.
    pub fn start_tls(dir: PathBuf, tls: EtcdTls) -> Etcd {
        for _ in 0..3 {
            let mut e = Etcd {
                child: None,
                dir: dir.clone(),
                client_port: free_port(),
                peer_port: free_port(),
                tls: Some(tls.clone()),
            };
            if e.spawn() {
                return e;
            }
        }
        panic!("etcd (TLS) did not come up in three attempts");
    }

    /// Runs `etcdctl ARGS` against this etcd (with its TLS files, if any):
    /// (success, stdout + stderr).
    pub fn etcdctl(&self, args: &[&str]) -> (bool, String) {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={scheme}://{}", self.endpoint()))
            .args(self.tls.as_ref().map(EtcdTls::etcdctl_args).unwrap_or_default())
            .args(["--dial-timeout=2s", "--command-timeout=5s"])
            .args(args)
            .output()
            .expect("etcdctl (Debian etcd-client; scripts/deps.sh installs it)");
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    }

    /// `127.0.0.1:PORT` for kv-mds `--etcd`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) -> bool {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let tls_args: Vec<String> = match &self.tls {
            Some(t) => vec![
                format!("--cert-file={}", t.server_cert.display()),
                format!("--key-file={}", t.server_key.display()),
                format!("--trusted-ca-file={}", t.ca.display()),
                "--client-cert-auth".into(),
            ],
            None => Vec::new(),
        };
        let child = Command::new(etcd_bin())
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.join("etcd"))
            .args(&tls_args)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}"), "--initial-cluster-state", "new"])
            .args(["--log-level", "error", "--logger", "zap"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(st) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                let _ = st;
                self.child = None;
                return false;
            }
            if self.healthy() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop();
        false
    }

    /// etcd's /health says true (over TLS: `etcdctl endpoint health`).
    pub fn healthy(&self) -> bool {
        if self.tls.is_some() {
            return self.etcdctl(&["endpoint", "health"]).0;
        }
        let mut c = kv_common::mds::MdsClient::new(vec![self.endpoint()], Duration::from_millis(500));
        matches!(c.call("GET", "/health", None, Duration::ZERO), Ok((200, b)) if String::from_utf8_lossy(&b).contains("true"))
    }

    /// SIGKILL and reap (the data dir stays).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same ports; `wipe` starts from an empty data dir
    /// (etcd's state lost), else from the data it had.
    pub fn restart(&mut self, wipe: bool) {
        self.stop();
        if wipe {
            std::fs::remove_dir_all(self.dir.join("etcd")).expect("remove etcd's data dir");
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.spawn() {
            assert!(Instant::now() < deadline, "etcd did not restart on its ports");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running `kv-mds` replica.
pub struct Mds {
    child: Option<Child>,
    pub addr: String,
    pub stderr_lines: mpsc::Receiver<String>,
}

impl Mds {
    /// `kv-mds --listen LISTEN --etcd ETCD --lease-ttl TTL`.
    pub fn start_at(listen: &str, etcd: &str, ttl: &str) -> Mds {
        Mds::start_with(listen, etcd, ttl, &[])
    }

    /// As [`Mds::start_at`], with more flags.
    pub fn start_with(listen: &str, etcd: &str, ttl: &str, extra: &[&str]) -> Mds {
        Mds::start_bin("kv-mds", listen, etcd, ttl, extra)
    }

    /// As [`Mds::start_with`] with another `kv-mds` binary (a path).
    pub fn start_bin(binary: &str, listen: &str, etcd: &str, ttl: &str, extra: &[&str]) -> Mds {
        let mut args = vec!["--listen", listen, "--etcd", etcd, "--lease-ttl", ttl, "--log-level", "info"];
        args.extend_from_slice(extra);
        let (child, addr, stderr_lines) = spawn_daemon(binary, &args, "kv-mds listening on ");
        Mds { child: Some(child), addr, stderr_lines }
    }

    /// `binary` (a workspace name or a path) on a port it picks, its stderr
    /// appended to `log`.
    pub fn start_logged(binary: &str, etcd: &str, ttl: &str, log: &std::path::Path) -> Mds {
        let args = ["--listen", "127.0.0.1:0", "--etcd", etcd, "--lease-ttl", ttl, "--log-level", "info"];
        let spawned = crate::try_spawn_daemon_with(binary, &args, "kv-mds listening on ", &[], Some(log));
        let (child, addr, stderr_lines) = spawned.unwrap_or_else(|e| panic!("{e}"));
        Mds { child: Some(child), addr, stderr_lines }
    }

    /// As [`Mds::start_at`], with `env` added to its environment (test-only
    /// hooks such as `KVMDS_TEST_FREEZE_HELD_VIEW`).
    pub fn start_env(listen: &str, etcd: &str, ttl: &str, env: &[(&str, &str)]) -> Mds {
        let args = ["--listen", listen, "--etcd", etcd, "--lease-ttl", ttl, "--log-level", "info"];
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let spawned = crate::try_spawn_daemon_with("kv-mds", &args, "kv-mds listening on ", &env, None);
        let (child, addr, stderr_lines) = spawned.unwrap_or_else(|e| panic!("{e}"));
        Mds { child: Some(child), addr, stderr_lines }
    }

    /// As [`Mds::start_at`], trying `attempts` times (the address may be
    /// taken for a moment by another socket after its previous owner died).
    pub fn try_start_at(listen: &str, etcd: &str, ttl: &str, attempts: usize) -> Result<Mds, String> {
        let args = ["--listen", listen, "--etcd", etcd, "--lease-ttl", ttl, "--log-level", "info"];
        let mut last = String::new();
        for _ in 0..attempts {
            match crate::try_spawn_daemon("kv-mds", &args, "kv-mds listening on ") {
                Ok((child, addr, stderr_lines)) => return Ok(Mds { child: Some(child), addr, stderr_lines }),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        Err(last)
    }

    pub fn start(etcd: &str, ttl: &str) -> Mds {
        Mds::start_at("127.0.0.1:0", etcd, ttl)
    }

    /// Its process id (0 once reaped).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Sends a signal to this replica (only to the process we started):
    /// SIGSTOP makes it a replica that accepts connections and never answers.
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Everything it logged so far (drains the channel).
    pub fn log(&self) -> Vec<String> {
        self.stderr_lines.try_iter().collect()
    }
}

impl Drop for Mds {
    fn drop(&mut self) {
        self.kill9();
    }
}
