//! Access control (docs/DEPLOY.md, "Access control"): an optional
//! credential file per group, shared by the group's nodes and the kv-mds
//! replicas; each client holds its own token.
//!
//! A token is always read from a file, never taken from a command line
//! (argv is visible to every user of the host). A file holds either one
//! bare token (the group's only credential, which may do everything: the
//! format of every release before roles), or a table of credentials, a
//! line each (`#` starts a comment):
//!
//! ```text
//! TOKEN role=engine [tenant=NAME]
//! TOKEN role=node [node=ID]
//! TOKEN role=admin
//! ```
//!
//! [`Credentials::read`] reads either form (nodes and kv-mds);
//! [`read_token_file`] reads the one token a client presents (a bare
//! token, or a table of one line). Tokens are 1..=[`MAX_TOKEN_LEN`]
//! visible ASCII characters, compared in time that depends only on the
//! expected tokens ([`Token::matches`], [`Credentials::find`]).
//!
//! The token proves membership of a group and its role there; it is not
//! encryption: pages and the token itself cross the network in the clear.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// Longest token accepted (bytes).
pub const MAX_TOKEN_LEN: usize = 1024;

/// The variable every client other than the C ABI reads for its token file.
pub const TOKEN_FILE_ENV: &str = "KVCELLAR_AUTH_TOKEN_FILE";

/// The variable kvctl reads for the admin token it presents for changes to
/// a group.
pub const ADMIN_TOKEN_FILE_ENV: &str = "KVCELLAR_ADMIN_TOKEN_FILE";

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

/// Longest credential file read (a table of a few thousand lines).
const MAX_FILE: usize = 1 << 20;

/// Most credentials in one file.
pub const MAX_CREDENTIALS: usize = 10_000;

/// What a credential may do in its group (docs/DEPLOY.md, "Roles").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Reads views; reads and writes pages.
    Engine,
    /// Also registers, heartbeats and deregisters a node (its own, when
    /// the credential names one).
    Node,
    /// Everything, including changes to the group (its placement rule).
    Admin,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Engine => "engine",
            Role::Node => "node",
            Role::Admin => "admin",
        }
    }
}

/// One line of a credential file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    pub token: Token,
    pub role: Role,
    /// The tenant it admits (`tenant=`); None: the default tenant.
    pub tenant: Option<String>,
    /// For a node credential, the one node id it may act for (`node=`);
    /// None: any node.
    pub node: Option<String>,
}

impl Credential {
    /// Whether it may register, heartbeat or deregister the node `id`.
    pub fn may_act_for_node(&self, id: &str) -> bool {
        match self.role {
            Role::Admin => true,
            Role::Node => self.node.as_deref().is_none_or(|n| n == id),
            Role::Engine => false,
        }
    }
}

/// A group's credentials, as a node or a kv-mds holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    entries: Vec<Credential>,
}

impl Credentials {
    /// One bare token that may do everything (the format before roles).
    pub fn single(token: Token) -> Credentials {
        Credentials { entries: vec![Credential { token, role: Role::Admin, tenant: None, node: None }] }
    }

    /// Reads a credential file (either form). Errors name the file and
    /// the line, and say what is wrong.
    pub fn read(path: &Path) -> Result<Credentials, String> {
        let what = || format!("auth token file {}", path.display());
        let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", what()))?;
        let mut text = Vec::new();
        f.take(MAX_FILE as u64 + 1).read_to_end(&mut text).map_err(|e| format!("{}: {e}", what()))?;
        if text.len() > MAX_FILE {
            return Err(format!("{}: longer than 1 MiB, not a token file", what()));
        }
        Credentials::parse(&text).map_err(|e| format!("{}: {e}", what()))
    }

    /// Parses a credential file's contents: one bare token, or a table.
    pub fn parse(text: &[u8]) -> Result<Credentials, String> {
        let trimmed = text.trim_ascii();
        if !trimmed.is_empty() && !trimmed.iter().any(|b| b.is_ascii_whitespace()) {
            return Ok(Credentials::single(Token::new(trimmed)?));
        }
        let text = std::str::from_utf8(text).map_err(|_| "not UTF-8 text".to_string())?;
        let mut entries: Vec<Credential> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = strip_comment(line).trim();
            if line.is_empty() {
                continue;
            }
            let at = |e: String| format!("line {}: {e}", n + 1);
            let c = parse_line(line).map_err(at)?;
            if entries.iter().any(|e| e.token == c.token) {
                return Err(at("this token is given twice".into()));
            }
            if entries.len() == MAX_CREDENTIALS {
                return Err(format!("more than {MAX_CREDENTIALS} credentials"));
            }
            entries.push(c);
        }
        if entries.is_empty() {
            return Err("the token is empty (no credential in the file)".into());
        }
        // Nodes know a tenant by its id: two names with one id would share
        // pages.
        let mut ids: BTreeMap<u32, &str> = BTreeMap::new();
        for name in entries.iter().filter_map(|e| e.tenant.as_deref()) {
            if let Some(other) = ids.insert(crate::quota::tenant_id_of(name), name).filter(|o| *o != name) {
                return Err(format!("tenants {other:?} and {name:?} have the same id: rename one"));
            }
        }
        Ok(Credentials { entries })
    }

    /// The credential whose token `offered` is, if any. Every credential's
    /// token is compared in full, so the time taken does not depend on
    /// which one (if any) matched.
    pub fn find(&self, offered: &[u8]) -> Option<&Credential> {
        let mut found = None;
        for c in &self.entries {
            if c.token.matches(offered) && found.is_none() {
                found = Some(c);
            }
        }
        found
    }

    pub fn entries(&self) -> &[Credential] {
        &self.entries
    }

    /// The token a node presents to kv-mds and to other nodes: its node
    /// credential for `id` (one that names `id`, else one that names no
    /// node), else an admin one (a bare single token is one). Err names the
    /// line to add: a node holding only an engine's token, or one bound to
    /// another id, would be refused by kv-mds at every heartbeat.
    pub fn for_node(&self, id: Option<&str>) -> Result<Token, String> {
        let named = |c: &&Credential| c.role == Role::Node && id.is_some() && c.node.as_deref() == id;
        let any_node = |c: &&Credential| c.role == Role::Node && c.node.is_none();
        let admin = |c: &&Credential| c.role == Role::Admin;
        let e = self.entries.iter();
        e.clone()
            .find(named)
            .or_else(|| e.clone().find(any_node))
            .or_else(|| e.clone().find(admin))
            .map(|c| c.token.clone())
            .ok_or_else(|| match id {
                Some(id) => format!("no credential this node may present: add a line `TOKEN role=node node={id}`"),
                None => "no credential this node may present: add a line `TOKEN role=node`".into(),
            })
    }
}

/// A tenant's id, as nodes keep it: a 32-bit FNV-1a hash of its name,
/// never 0 (the default tenant's id, of every credential that names none).
pub fn tenant_id(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h.max(1)
}

impl Credential {
    /// The id of the tenant it admits (0: the default tenant, also when
    /// it is named `default`).
    pub fn tenant_id(&self) -> u32 {
        self.tenant.as_deref().map_or(0, crate::quota::tenant_id_of)
    }
}

/// A table line without its comment: from a `#` that starts the line or
/// follows whitespace (a `#` inside a token is the token's).
fn strip_comment(line: &str) -> &str {
    let b = line.as_bytes();
    match (0..b.len()).find(|&i| b[i] == b'#' && (i == 0 || b[i - 1].is_ascii_whitespace())) {
        Some(i) => &line[..i],
        None => line,
    }
}

/// One table line: `TOKEN role=ROLE [tenant=NAME] [node=ID]`.
fn parse_line(line: &str) -> Result<Credential, String> {
    let mut fields = line.split_ascii_whitespace();
    let token = Token::new(fields.next().unwrap_or("").as_bytes())?;
    let (mut role, mut tenant, mut node) = (None, None, None);
    for f in fields {
        let (k, v) = f
            .split_once('=')
            .ok_or_else(|| format!("{f:?} is not role=..., tenant=... or node=... (a token has no spaces)"))?;
        let slot = match k {
            "role" => {
                let r = match v {
                    "engine" => Role::Engine,
                    "node" => Role::Node,
                    "admin" => Role::Admin,
                    _ => return Err(format!("role {v:?} is not engine, node or admin")),
                };
                if role.replace(r).is_some() {
                    return Err("role is given twice".into());
                }
                continue;
            }
            "tenant" => &mut tenant,
            "node" => &mut node,
            _ => return Err(format!("{k:?} is not role, tenant or node")),
        };
        if !valid_name(v) {
            return Err(format!("{k} {v:?} must be 1-64 of A-Z a-z 0-9 . _ -"));
        }
        if k == "tenant" && v == crate::quota::DEFAULT_TENANT {
            return Err("tenant=default names the default tenant: leave tenant= out".into());
        }
        if slot.replace(v.to_string()).is_some() {
            return Err(format!("{k} is given twice"));
        }
    }
    let role = role.ok_or("no role= (engine, node or admin)")?;
    if node.is_some() && role != Role::Node {
        return Err("node= is for role=node only".into());
    }
    Ok(Credential { token, role, tenant, node })
}

/// Credentials a daemon holds while serving, replaced as a whole when its
/// files are read again (SIGHUP, docs/DEPLOY.md "Rotating tokens"): a
/// check takes the set current when it begins.
#[derive(Debug, Default)]
pub struct Reloadable<T>(std::sync::RwLock<Arc<T>>);

impl<T> Reloadable<T> {
    pub fn new(value: T) -> Reloadable<T> {
        Reloadable(std::sync::RwLock::new(Arc::new(value)))
    }

    /// The current value.
    pub fn get(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the value; checks begun before keep the one they took.
    pub fn set(&self, value: T) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(value);
    }
}

/// Reads the token a client presents: a file of one bare token, or a
/// table of one credential. Errors name the file and say what is wrong.
pub fn read_token_file(path: &Path) -> Result<Token, String> {
    let c = Credentials::read(path)?;
    match c.entries() {
        [only] => Ok(only.token.clone()),
        many => Err(format!(
            "auth token file {}: holds {} credentials; a client presents one (give it a file with its own token)",
            path.display(),
            many.len()
        )),
    }
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

/// The credentials a kv-mds checks: one file for every group, and
/// per-group ones that take precedence. A group with neither is open.
#[derive(Debug, Clone, Default)]
pub struct GroupTokens {
    pub all: Option<Credentials>,
    pub groups: BTreeMap<String, Credentials>,
}

impl GroupTokens {
    /// The credentials calls for `group` must carry one of, if any.
    pub fn for_group(&self, group: &str) -> Option<&Credentials> {
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
        self.groups.insert(group.to_string(), Credentials::read(Path::new(path))?);
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
        for (text, why) in [("\n \n", "empty"), ("two words", "not role="), ("caf\u{e9}", "not visible ASCII")] {
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
        assert!(g.for_group("ga").unwrap().find(b"tok-a").is_some());
        assert!(g.for_group("gb").is_none());
        g.all = Some(Credentials::single(Token::new(b"tok-all").unwrap()));
        assert!(g.for_group("gb").unwrap().find(b"tok-all").is_some());
        assert!(g.for_group("ga").unwrap().find(b"tok-all").is_none(), "a group's own file wins");
        assert!(g.add_group_spec(&format!("ga={}", p.display())).unwrap_err().contains("twice"));
        assert!(g.add_group_spec("nogroup").unwrap_err().contains("GROUP=PATH"));
        assert!(g.add_group_spec("a/b=/x").unwrap_err().contains("group"));
    }

    /// A table: roles, tenants, node ids; comments and blank lines; the
    /// token each party presents; one clear error a line.
    #[test]
    fn credential_tables_name_roles_tenants_and_nodes() {
        let text = "# prod\n\
                    eng-a role=engine tenant=team-a   # team A's engines\n\
                    \n\
                    eng-b   role=engine tenant=team-b\n\
                    n7-tok role=node node=n7\n\
                    any-node role=node\n\
                    adm role=admin\n";
        let c = Credentials::parse(text.as_bytes()).unwrap();
        assert_eq!(c.entries().len(), 5);
        let a = c.find(b"eng-a").unwrap();
        assert_eq!((a.role, a.tenant.as_deref()), (Role::Engine, Some("team-a")));
        assert!(!a.may_act_for_node("n1"));
        let n7 = c.find(b"n7-tok").unwrap();
        assert!(n7.may_act_for_node("n7") && !n7.may_act_for_node("n8"));
        assert!(c.find(b"any-node").unwrap().may_act_for_node("n8"));
        assert!(c.find(b"adm").unwrap().may_act_for_node("n8"));
        assert!(c.find(b"eng").is_none() && c.find(b"").is_none());
        assert_eq!(c.for_node(Some("n7")).unwrap().as_bytes(), b"n7-tok");
        assert_eq!(c.for_node(Some("n9")).unwrap().as_bytes(), b"any-node");
        assert_eq!(c.for_node(None).unwrap().as_bytes(), b"any-node");
        let engines = Credentials::parse(b"e1 role=engine\ne2 role=engine tenant=t").unwrap();
        assert!(engines.for_node(Some("n1")).unwrap_err().contains("role=node node=n1"));
        // A table of one line is checked as any: an engine's token or one
        // bound to another node is no node's credential.
        let one = Credentials::parse(b"e1 role=engine\n").unwrap();
        assert!(one.for_node(Some("n1")).is_err());
        let bound = Credentials::parse(b"n7 role=node node=n7\n").unwrap();
        assert_eq!(bound.for_node(Some("n7")).unwrap().as_bytes(), b"n7");
        assert!(bound.for_node(Some("n8")).unwrap_err().contains("node=n8"));
        // A `#` inside a token is the token's; one after a space starts a comment.
        let hashed = Credentials::parse(b"ab#cd role=engine #a comment\n#whole line\n").unwrap();
        assert!(hashed.find(b"ab#cd").is_some() && hashed.entries().len() == 1);
        // The format before roles: one bare token, which may do everything.
        let bare = Credentials::parse(b"  s3cret\n").unwrap();
        assert_eq!(bare.find(b"s3cret").unwrap().role, Role::Admin);
        assert_eq!(bare.for_node(Some("n1")).unwrap().as_bytes(), b"s3cret");
        for (text, why) in [
            ("t1 role=root", "line 1: role \"root\" is not engine, node or admin"),
            ("t1 tenant=a", "line 1: no role="),
            ("t1 role=engine\nt1 role=admin", "line 2: this token is given twice"),
            ("t1 role=engine node=n1", "node= is for role=node only"),
            ("t1 role=engine tenant=a/b", "tenant \"a/b\" must be"),
            ("t1 role=engine color=red", "\"color\" is not role, tenant or node"),
            ("t1 role=engine role=admin", "role is given twice"),
            ("t1 role=engine tenant=default", "leave tenant= out"),
            ("# nothing here\n", "no credential"),
        ] {
            let e = Credentials::parse(text.as_bytes()).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        std::fs::write(&p, "c1 role=engine tenant=x\n").unwrap();
        assert_eq!(read_token_file(&p).unwrap().as_bytes(), b"c1", "a table of one: its token");
        std::fs::write(&p, text).unwrap();
        let e = read_token_file(&p).unwrap_err();
        assert!(e.contains("holds 5 credentials"), "{e}");
        // Tenant ids: stable, never the default's.
        assert_eq!(tenant_id("team-a"), tenant_id("team-a"));
        assert_ne!(tenant_id("team-a"), tenant_id("team-b"));
        assert_ne!(tenant_id(""), 0);
        assert_eq!(c.find(b"eng-a").unwrap().tenant_id(), tenant_id("team-a"));
        assert_eq!(c.find(b"adm").unwrap().tenant_id(), 0);
    }
}
