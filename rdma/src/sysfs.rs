//! What sysfs says about RDMA devices: whether a named device exists, which
//! of its ports is active, its link layer, the GID index to use (RoCE v2
//! when the link is Ethernet) and its NUMA node. Reads a tree rooted
//! anywhere, so tests give it a fake one.
//!
//! ```text
//! class/infiniband/<dev>/device/numa_node          "-1" or the node
//! class/infiniband/<dev>/ports/<n>/state           "4: ACTIVE"
//! class/infiniband/<dev>/ports/<n>/link_layer      "InfiniBand" | "Ethernet"
//! class/infiniband/<dev>/ports/<n>/gids/<i>        "fe80:0000:...:0001"
//! class/infiniband/<dev>/ports/<n>/gid_attrs/types/<i>   "IB/RoCE v1" | "RoCE v2"
//! ```

use std::path::{Path, PathBuf};

use super::RailSpec;

/// Most GID table entries looked at per port.
const MAX_GIDS: u8 = 32;

/// A sysfs tree (normally `/sys`).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs { root: PathBuf::from("/sys") }
    }
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

impl Sysfs {
    pub fn at(root: &Path) -> Sysfs {
        Sysfs { root: root.to_path_buf() }
    }

    fn dev(&self, name: &str) -> PathBuf {
        self.root.join("class/infiniband").join(name)
    }

    /// The RDMA devices present, sorted.
    pub fn devices(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.root.join("class/infiniband"))
            .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// The device's NUMA node (None: unknown, or a machine without NUMA).
    pub fn numa_node(&self, name: &str) -> Option<u32> {
        read(&self.dev(name).join("device/numa_node"))?.parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
    }

    /// The rail a named device gives: its first active port, that port's
    /// link layer and GID index, its NUMA node. Err says why not.
    pub fn rail(&self, name: &str) -> Result<RailSpec, String> {
        let dev = self.dev(name);
        if !dev.exists() {
            let present = self.devices();
            let have = if present.is_empty() { "none present".to_string() } else { present.join(", ") };
            return Err(format!(
                "no such RDMA device (no {}; devices: {have})",
                Path::new("/sys/class/infiniband").join(name).display()
            ));
        }
        let mut ports: Vec<u8> = std::fs::read_dir(dev.join("ports"))
            .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
            .unwrap_or_default();
        ports.sort_unstable();
        let mut states = Vec::new();
        for port in ports {
            let p = dev.join("ports").join(port.to_string());
            let state = read(&p.join("state")).unwrap_or_default();
            if state.ends_with("ACTIVE") && !state.ends_with("INACTIVE") {
                let link_layer = read(&p.join("link_layer")).unwrap_or_else(|| "InfiniBand".into());
                let gid_index = gid_index(&p, &link_layer)?;
                return Ok(RailSpec {
                    device: name.to_string(),
                    port,
                    gid_index,
                    numa_node: self.numa_node(name),
                    link_layer,
                });
            }
            states.push(format!("port {port} {state}"));
        }
        Err(format!("no active port ({})", if states.is_empty() { "no ports".into() } else { states.join(", ") }))
    }
}

fn gid_is_set(g: &str) -> bool {
    g.bytes().any(|b| b != b'0' && b != b':')
}

/// InfiniBand uses GID 0. RoCE needs a RoCE v2 entry (routable over UDP),
/// preferring one that maps an IPv4 address; a port with only RoCE v1
/// entries falls back to the first set one.
fn gid_index(port: &Path, link_layer: &str) -> Result<u8, String> {
    if link_layer != "Ethernet" {
        return Ok(0);
    }
    let mut v2 = Vec::new();
    let mut any = None;
    for i in 0..MAX_GIDS {
        let Some(gid) = read(&port.join("gids").join(i.to_string())) else { continue };
        if !gid_is_set(&gid) {
            continue;
        }
        any.get_or_insert(i);
        if read(&port.join("gid_attrs/types").join(i.to_string())).is_some_and(|t| t == "RoCE v2") {
            v2.push((i, gid.starts_with("0000:0000:0000:0000:0000:ffff:")));
        }
    }
    if let Some((i, _)) = v2.iter().find(|(_, v4)| *v4).or(v2.first()) {
        return Ok(*i);
    }
    any.ok_or_else(|| "RoCE port has no GID set (no IP address on its netdev?)".to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a fake device with one port.
    pub(crate) fn fake_device(root: &Path, name: &str, numa: i32, link: &str, state: &str) {
        let d = root.join("class/infiniband").join(name);
        std::fs::create_dir_all(d.join("device")).unwrap();
        std::fs::write(d.join("device/numa_node"), format!("{numa}\n")).unwrap();
        let p = d.join("ports/1");
        std::fs::create_dir_all(p.join("gids")).unwrap();
        std::fs::create_dir_all(p.join("gid_attrs/types")).unwrap();
        std::fs::write(p.join("state"), format!("{state}\n")).unwrap();
        std::fs::write(p.join("link_layer"), format!("{link}\n")).unwrap();
        std::fs::write(p.join("gids/0"), "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n").unwrap();
        std::fs::write(p.join("gid_attrs/types/0"), "IB/RoCE v1\n").unwrap();
    }

    #[test]
    fn reads_devices_ports_and_numa() {
        let d = tempfile::tempdir().unwrap();
        let fs = Sysfs::at(d.path());
        assert!(fs.devices().is_empty());
        let e = fs.rail("mlx5_0").unwrap_err();
        assert!(e.contains("no such RDMA device") && e.contains("none present"), "{e}");
        fake_device(d.path(), "mlx5_0", 1, "InfiniBand", "4: ACTIVE");
        fake_device(d.path(), "mlx5_1", -1, "InfiniBand", "1: DOWN");
        assert_eq!(fs.devices(), ["mlx5_0", "mlx5_1"]);
        let r = fs.rail("mlx5_0").unwrap();
        assert_eq!((r.port, r.gid_index, r.numa_node, r.link_layer.as_str()), (1, 0, Some(1), "InfiniBand"));
        assert_eq!(fs.numa_node("mlx5_1"), None);
        assert!(fs.rail("mlx5_1").unwrap_err().contains("port 1 1: DOWN"));
        assert!(fs.rail("mlx5_2").unwrap_err().contains("devices: mlx5_0, mlx5_1"));
        // A second port that is active is used when the first is not.
        let p2 = d.path().join("class/infiniband/mlx5_1/ports/2");
        std::fs::create_dir_all(&p2).unwrap();
        std::fs::write(p2.join("state"), "4: ACTIVE\n").unwrap();
        assert_eq!(fs.rail("mlx5_1").unwrap().port, 2);
    }

    #[test]
    fn roce_ports_take_a_routable_v2_gid() {
        let d = tempfile::tempdir().unwrap();
        fake_device(d.path(), "rocep1s0", 0, "Ethernet", "4: ACTIVE");
        let p = d.path().join("class/infiniband/rocep1s0/ports/1");
        let fs = Sysfs::at(d.path());
        // Only a v1 entry: that one.
        assert_eq!(fs.rail("rocep1s0").unwrap().gid_index, 0);
        std::fs::write(p.join("gids/1"), "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n").unwrap();
        std::fs::write(p.join("gid_attrs/types/1"), "RoCE v2\n").unwrap();
        assert_eq!(fs.rail("rocep1s0").unwrap().gid_index, 1);
        std::fs::write(p.join("gids/3"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n").unwrap();
        std::fs::write(p.join("gid_attrs/types/3"), "RoCE v2\n").unwrap();
        std::fs::write(p.join("gids/2"), "0000:0000:0000:0000:0000:0000:0000:0000\n").unwrap();
        assert_eq!(fs.rail("rocep1s0").unwrap().gid_index, 3);
        // No GID at all: not usable, and the reason says so.
        for i in 0..4 {
            let _ = std::fs::remove_file(p.join("gids").join(i.to_string()));
        }
        assert!(fs.rail("rocep1s0").unwrap_err().contains("no GID"));
    }
}
