//! Access control (docs/DEPLOY.md, "Access control"): an optional token per
//! group, shared by the group's nodes, its clients and the kv-mds replicas.
//!
//! A token is always read from a file, never taken from a command line
//! (argv is visible to every user of the host). [`read_token_file`] is the
//! one reader every part uses: the file's contents trimmed of surrounding
//! whitespace, 1..=[`MAX_TOKEN_LEN`] visible ASCII characters. Tokens are
//! compared in time that depends only on the expected token's length
//! ([`Token::matches`]).
//!
//! The token proves membership of a group; it is not encryption: pages and
//! the token itself cross the network in the clear.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// Longest token accepted (bytes).
pub const MAX_TOKEN_LEN: usize = 1024;

/// The variable every client other than the C ABI reads for its token file.
pub const TOKEN_FILE_ENV: &str = "KVCELLAR_AUTH_TOKEN_FILE";

/// A group's secret. Its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<[u8]>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<{} bytes>)", self.0.len())
    }
}

impl Token {
    /// A token from its text: 1..=1024 characters, each visible ASCII
    /// (`!` to `~`), so it travels unchanged in an HTTP header and a hello.
    pub fn new(text: &[u8]) -> Result<Token, String> {
        if text.is_empty() {
            return Err("the token is empty".into());
        }
        if text.len() > MAX_TOKEN_LEN {
            return Err(format!("the token is {} bytes long; at most {MAX_TOKEN_LEN} are allowed", text.len()));
        }
        if let Some(i) = text.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(format!(
                "the token has a character that is not visible ASCII at byte {i} (use e.g. `openssl rand -hex 32`)"
            ));
        }
        Ok(Token(text.into()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether `offered` is this token, compared in constant time (for a
    /// given expected length): every byte of the expected token is looked
    /// at whatever `offered` holds.
    pub fn matches(&self, offered: &[u8]) -> bool {
        ct_eq(&self.0, offered)
    }
}

/// `expected == offered`, taking time that depends only on `expected.len()`.
pub fn ct_eq(expected: &[u8], offered: &[u8]) -> bool {
    let mut diff = expected.len() ^ offered.len();
    for (i, e) in expected.iter().enumerate() {
        let o = offered.get(i).copied().unwrap_or(0);
        diff |= usize::from(std::hint::black_box(e ^ o));
    }
    std::hint::black_box(diff) == 0
}

/// Reads a token file: its contents trimmed of surrounding whitespace must
/// be a valid [`Token`]. Errors name the file and say what is wrong.
pub fn read_token_file(path: &Path) -> Result<Token, String> {
    let what = || format!("auth token file {}", path.display());
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", what()))?;
    let mut text = Vec::new();
    // A token is short: a file much longer is the wrong file.
    f.take(64 * 1024 + 1).read_to_end(&mut text).map_err(|e| format!("{}: {e}", what()))?;
    if text.len() > 64 * 1024 {
        return Err(format!("{}: longer than 64 KiB, not a token file", what()));
    }
    Token::new(text.trim_ascii()).map_err(|e| format!("{}: {e}", what()))
}

/// A warning when the token file is open to more than its owner and its
/// group's reading (any bit for others, or group write), None otherwise:
/// 600, or 640 with the service's group as docs/DEPLOY.md sets it.
pub fn loose_permissions(path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o037 != 0).then(|| {
        format!(
            "auth token file {} has mode {:o}: other users may read or change it (chmod 600 or 640)",
            path.display(),
            mode & 0o777
        )
    })
}

/// The tokens a kv-mds checks: one for every group, and per-group ones that
/// take precedence. A group with neither is open.
#[derive(Debug, Clone, Default)]
pub struct GroupTokens {
    pub all: Option<Token>,
    pub groups: BTreeMap<String, Token>,
}

impl GroupTokens {
    /// The token calls for `group` must carry, if any.
    pub fn for_group(&self, group: &str) -> Option<&Token> {
        self.groups.get(group).or(self.all.as_ref())
    }

    /// Whether no group needs a token.
    pub fn is_open(&self) -> bool {
        self.all.is_none() && self.groups.is_empty()
    }

    /// Adds `GROUP=PATH` (kv-mds `--group-token-file`), reading the file.
    pub fn add_group_spec(&mut self, spec: &str) -> Result<(), String> {
        let (group, path) =
            spec.split_once('=').ok_or_else(|| format!("--group-token-file {spec:?} is not GROUP=PATH"))?;
        if !valid_name(group) {
            return Err(format!("--group-token-file: group {group:?} must be 1-64 of A-Z a-z 0-9 . _ -"));
        }
        if path.is_empty() {
            return Err(format!("--group-token-file {spec:?} names no file"));
        }
        if self.groups.contains_key(group) {
            return Err(format!("--group-token-file: group {group} is given twice"));
        }
        self.groups.insert(group.to_string(), read_token_file(Path::new(path))?);
        Ok(())
    }
}

/// A group or node id: 1..=64 of `[A-Za-z0-9._-]`, so it is safe in etcd
/// keys and URLs as is.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_equality() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert!(!ct_eq(b"abc", b"abcd"));
        assert!(!ct_eq(b"abc", b""));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn token_files_are_trimmed_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        std::fs::write(&p, "  s3cret-token\n\n").unwrap();
        let t = read_token_file(&p).unwrap();
        assert_eq!(t.as_bytes(), b"s3cret-token");
        assert!(t.matches(b"s3cret-token") && !t.matches(b"s3cret-token "));
        assert!(!format!("{t:?}").contains("s3cret"), "Debug must not show the token");
        for (text, why) in [("\n \n", "empty"), ("two words", "not visible ASCII"), ("caf\u{e9}", "not visible ASCII")]
        {
            std::fs::write(&p, text).unwrap();
            let e = read_token_file(&p).unwrap_err();
            assert!(e.contains(why) && e.contains("auth token file"), "{e}");
        }
        std::fs::write(&p, "x".repeat(MAX_TOKEN_LEN + 1)).unwrap();
        assert!(read_token_file(&p).unwrap_err().contains("at most 1024"));
        let e = read_token_file(&d.path().join("none")).unwrap_err();
        assert!(e.contains("none") && e.contains("No such file"), "{e}");
    }

    #[test]
    fn permissions_and_group_specs() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a");
        std::fs::write(&p, "tok-a").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(loose_permissions(&p), None);
        // The documented mode: readable by the service's group only.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(loose_permissions(&p), None, "640 (root:kvcellar) is what docs/DEPLOY.md asks for");
        for loose in [0o644, 0o660, 0o604] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(loose)).unwrap();
            assert!(loose_permissions(&p).unwrap().contains(&format!("{loose:o}")), "{loose:o}");
        }
        let mut g = GroupTokens::default();
        assert!(g.is_open());
        g.add_group_spec(&format!("ga={}", p.display())).unwrap();
        assert_eq!(g.for_group("ga").unwrap().as_bytes(), b"tok-a");
        assert!(g.for_group("gb").is_none());
        g.all = Some(Token::new(b"tok-all").unwrap());
        assert_eq!(g.for_group("gb").unwrap().as_bytes(), b"tok-all");
        assert_eq!(g.for_group("ga").unwrap().as_bytes(), b"tok-a", "a group's own token wins");
        assert!(g.add_group_spec(&format!("ga={}", p.display())).unwrap_err().contains("twice"));
        assert!(g.add_group_spec("nogroup").unwrap_err().contains("GROUP=PATH"));
        assert!(g.add_group_spec("a/b=/x").unwrap_err().contains("group"));
    }
}
