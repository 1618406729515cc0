//! The Python ctypes binding (plugins/kvcellar/_native.py) against a real node.

use std::process::Command;

use kv_e2e::{bin, workspace_root, Node};

#[test]
fn python_ctypes_round_trip() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("d");
    let node = Node::start(&["--dir", d.to_str().unwrap(), "--cap", "64M", "--log-level", "warn"]);
    let out = Command::new("python3")
        .arg(workspace_root().join("tests/python/smoke_native.py"))
        .arg(bin("libkvclient.so"))
        .arg(format!("n1={}", node.addr))
        .output()
        .expect("python3");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("passed, 0 failed") && !text.contains("FAIL"), "{text}");
}
