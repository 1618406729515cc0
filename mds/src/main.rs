//! `kv-mds` placeholder binary (see the crate docs).

fn main() -> std::process::ExitCode {
    if std::env::args().any(|a| a == "--version" || a == "-V") {
        println!("kv-mds {}", env!("CARGO_PKG_VERSION"));
        return std::process::ExitCode::SUCCESS;
    }
    eprintln!("kv-mds: not implemented yet (membership arrives with the MDS issue)");
    std::process::ExitCode::from(2)
}
