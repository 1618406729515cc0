//! The C ABI as a C program sees it: the checked-in header against the Rust
//! definitions, and a C test program against real kv-server processes (under
//! valgrind when it is installed).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use kv_e2e::{bin, workspace_root, Node};
use kvclient::ffi;

fn header() -> String {
    std::fs::read_to_string(workspace_root().join("client-ffi/include/kvclient.h")).expect("kvclient.h")
}

fn squash(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(" *", "*")
        .replace("* ", "*")
        .replace("( ", "(")
        .replace(" )", ")")
}

/// Prototypes in the header: name -> normalised "ret name(args)".
fn header_prototypes(h: &str) -> BTreeMap<String, String> {
    let no_comments: String = {
        let mut out = String::new();
        let mut rest = h;
        while let Some(i) = rest.find("/*") {
            out.push_str(&rest[..i]);
            rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
        }
        out.push_str(rest);
        out
    };
    let mut protos = BTreeMap::new();
    for stmt in no_comments.split(';') {
        let s = squash(stmt);
        if s.contains("kv_") && s.contains('(') && !s.contains("typedef") && !s.contains('#') && !s.contains('{') {
            // The function name is the identifier right before the '('.
            let head = &s[..s.find('(').expect("(")];
            let name: String = head
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            protos.insert(name, s.trim().to_string());
        }
    }
    protos
}

fn c_type(rust: &str) -> String {
    let t = squash(rust);
    let map = [
        ("*mut kv_client", "kv_client*"),
        ("*const kv_client", "const kv_client*"),
        ("*const kv_geometry", "const kv_geometry*"),
        ("*const kv_iovec", "const kv_iovec*"),
        ("*const *const c_char", "const char*const*"),
        ("*const c_char", "const char*"),
        ("*mut c_char", "char*"),
        ("*const c_void", "const void*"),
        ("*mut c_void", "void*"),
        ("*const usize", "const size_t*"),
        ("*mut usize", "size_t*"),
        ("*mut c_int", "int*"),
        ("usize", "size_t"),
        ("c_int", "int"),
        ("u64", "uint64_t"),
        ("u32", "uint32_t"),
    ];
    map.iter()
        .find(|(r, _)| squash(r).replace(' ', "") == t.replace(' ', ""))
        .map(|(_, c)| c.to_string())
        .unwrap_or_else(|| panic!("no C type for Rust {rust}"))
}

/// Exported functions in ffi.rs, rendered as C prototypes.
fn rust_prototypes() -> BTreeMap<String, String> {
    let src = std::fs::read_to_string(workspace_root().join("client-ffi/src/ffi.rs")).expect("ffi.rs");
    let mut protos = BTreeMap::new();
    for chunk in src.split("#[no_mangle]").skip(1) {
        let sig = &chunk[..chunk.find('{').expect("fn body")];
        let sig = squash(sig);
        let name_at = sig.find("fn ").expect("fn") + 3;
        let name: String = sig[name_at..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let args_s = &sig[sig.find('(').unwrap() + 1..sig.rfind(')').unwrap()];
        let ret = sig[sig.rfind(')').unwrap() + 1..].trim().trim_start_matches("->").trim().to_string();
        let ret_c = if ret.is_empty() { "void".to_string() } else { c_type(&ret) };
        let args: Vec<String> = args_s
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| {
                let (n, t) = a.split_once(':').expect("name: type");
                format!("{} {}", c_type(t), n.trim())
            })
            .collect();
        let args = if args.is_empty() { "void".to_string() } else { args.join(", ") };
        protos.insert(name.clone(), squash(&format!("{ret_c} {name}({args})")));
    }
    protos
}

#[test]
fn the_header_matches_the_rust_definitions() {
    let h = header();
    // Functions: same names, same C types, argument names aside.
    let strip_names = |p: &str| -> String {
        // Drop parameter names: keep the type part of each argument.
        let (head, args) = p.split_once('(').unwrap();
        let args = args.trim_end_matches(')');
        let types: Vec<String> = args
            .split(',')
            .map(|a| {
                let a = a.trim();
                let cut = a.rfind(['*', ' ']).map(|i| &a[..=i]).unwrap_or(a);
                if a == "void" {
                    "void".into()
                } else {
                    squash(cut)
                }
            })
            .collect();
        squash(&format!("{head}({})", types.join(",")))
    };
    let from_h: BTreeMap<_, _> = header_prototypes(&h).into_iter().map(|(k, v)| (k, strip_names(&v))).collect();
    let from_rs: BTreeMap<_, _> = rust_prototypes().into_iter().map(|(k, v)| (k, strip_names(&v))).collect();
    assert_eq!(from_h, from_rs, "kvclient.h and client-ffi/src/ffi.rs disagree");
    assert_eq!(from_rs.len(), 21);
    // Status codes.
    for (name, v) in [
        ("KV_OK", ffi::KV_OK),
        ("KV_MISS", ffi::KV_MISS),
        ("KV_MISMATCH", ffi::KV_MISMATCH),
        ("KV_CORRUPT", ffi::KV_CORRUPT),
        ("KV_TOO_SMALL", ffi::KV_TOO_SMALL),
        ("KV_UNAVAILABLE", ffi::KV_UNAVAILABLE),
        ("KV_TIMEOUT", ffi::KV_TIMEOUT),
        ("KV_REJECTED", ffi::KV_REJECTED),
        ("KV_EINVAL", ffi::KV_EINVAL),
        ("KV_EINTERNAL", ffi::KV_EINTERNAL),
        ("KV_EDENIED", ffi::KV_EDENIED),
        ("KV_MAX_ITEM_IOVCNT", ffi::MAX_ITEM_IOVCNT as i32),
        ("KV_MAX_BATCH_ITEMS", ffi::MAX_BATCH_ITEMS as i32),
    ] {
        assert!(h.contains(&format!("#define {name} {v}\n")), "{name} = {v} in kvclient.h");
    }
    // Struct layouts, checked by the C compiler against Rust's.
    let t = tempfile::tempdir().unwrap();
    let c = t.path().join("layout.c");
    let g = |f: usize| f.to_string();
    use std::mem::{offset_of, size_of};
    let src = format!(
        "#include \"kvclient.h\"\n#include <stddef.h>\n\
         _Static_assert(sizeof(kv_iovec) == {}, \"kv_iovec size\");\n\
         _Static_assert(offsetof(kv_iovec, len) == {}, \"kv_iovec.len\");\n\
         _Static_assert(sizeof(kv_geometry) == {}, \"kv_geometry size\");\n\
         _Static_assert(offsetof(kv_geometry, page_size) == {}, \"page_size\");\n\
         _Static_assert(offsetof(kv_geometry, dtype_tag) == {}, \"dtype_tag\");\n\
         _Static_assert(offsetof(kv_geometry, tp_size) == {}, \"tp_size\");\n\
         _Static_assert(offsetof(kv_geometry, tp_rank) == {}, \"tp_rank\");\n\
         _Static_assert(offsetof(kv_geometry, layer_num) == {}, \"layer_num\");\n\
         _Static_assert(offsetof(kv_geometry, head_num) == {}, \"head_num\");\n\
         _Static_assert(offsetof(kv_geometry, head_dim) == {}, \"head_dim\");\n\
         _Static_assert(offsetof(kv_geometry, flags) == {}, \"flags\");\n\
         _Static_assert(KV_FLAG_MLA == {}, \"mla flag\");\n",
        g(size_of::<ffi::kv_iovec>()),
        g(offset_of!(ffi::kv_iovec, len)),
        g(size_of::<ffi::kv_geometry>()),
        g(offset_of!(ffi::kv_geometry, page_size)),
        g(offset_of!(ffi::kv_geometry, dtype_tag)),
        g(offset_of!(ffi::kv_geometry, tp_size)),
        g(offset_of!(ffi::kv_geometry, tp_rank)),
        g(offset_of!(ffi::kv_geometry, layer_num)),
        g(offset_of!(ffi::kv_geometry, head_num)),
        g(offset_of!(ffi::kv_geometry, head_dim)),
        g(offset_of!(ffi::kv_geometry, flags)),
        kv_common::page::FLAG_MLA,
    );
    std::fs::write(&c, src).unwrap();
    let inc = workspace_root().join("client-ffi/include");
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Werror", "-c", "-o"])
        .arg(t.path().join("layout.o"))
        .arg("-I")
        .arg(&inc)
        .arg(&c)
        .output()
        .expect("run cc");
    assert!(out.status.success(), "layouts differ:\n{}", String::from_utf8_lossy(&out.stderr));
    // The library exports exactly the header's functions.
    let nm = Command::new("nm").args(["-D", "--defined-only"]).arg(bin("libkvclient.so")).output().expect("nm");
    let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("kv_"))
        .map(String::from)
        .collect();
    assert_eq!(exported, from_h.keys().cloned().collect(), "exported symbols vs header");
}

/// Compiles tests/c/abi_test.c against the header and the library.
fn build_c_test(dir: &Path) -> std::path::PathBuf {
    let lib = bin("libkvclient.so");
    // The SONAME is libkvclient.so.0: give the loader that name.
    std::os::unix::fs::symlink(&lib, dir.join("libkvclient.so.0")).unwrap();
    std::os::unix::fs::symlink(&lib, dir.join("libkvclient.so")).unwrap();
    let exe = dir.join("abi_test");
    let out = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-o"])
        .arg(&exe)
        .arg(workspace_root().join("tests/c/abi_test.c"))
        .arg("-I")
        .arg(workspace_root().join("client-ffi/include"))
        .arg("-L")
        .arg(dir)
        .arg("-lkvclient")
        .arg("-pthread")
        .output()
        .expect("run cc");
    assert!(out.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

fn run_c(exe: &Path, lib_dir: &Path, args: &[&str]) -> String {
    let valgrind = Command::new("valgrind").arg("--version").output().is_ok_and(|o| o.status.success());
    let mut cmd = if valgrind {
        let mut c = Command::new("valgrind");
        c.args(["--quiet", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite"]);
        c.arg(exe);
        c
    } else {
        eprintln!("valgrind not installed: running the C test without it");
        Command::new(exe)
    };
    let out = cmd.args(args).env("LD_LIBRARY_PATH", lib_dir).output().expect("run abi_test");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "abi_test {args:?} failed ({:?}):\n{text}", out.status);
    assert!(!text.contains("FAIL"), "{text}");
    text
}

#[test]
fn a_c_program_against_real_nodes() {
    let t = tempfile::tempdir().unwrap();
    let nodes = Node::cluster(&t, 3, &[]);
    let members = Node::members(&nodes);
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("dead=127.0.0.1:{}", l.local_addr().unwrap().port())
    };
    let exe = build_c_test(t.path());
    let out = run_c(&exe, t.path(), &["put", &members, &dead]);
    assert!(out.matches("ok: ").count() >= 35, "{out}");
    // Flip one payload byte of "corrupt-me" on whichever disk holds it.
    let mut flipped = false;
    for i in 0..3 {
        let p = t.path().join(format!("n{i}/data.kvc"));
        let data = std::fs::read(&p).unwrap();
        if let Some(at) = data.windows(17).position(|w| w == b"CORRUPT-ME-MARKER") {
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            f.write_all_at(&[data[at + 1000] ^ 0x01], (at + 1000) as u64).unwrap();
            f.sync_all().unwrap();
            flipped = true;
        }
    }
    assert!(flipped, "the marker page was found on disk");
    run_c(&exe, t.path(), &["corrupt", &members]);
    drop(nodes);
}
