//! Gives libkvclient.so its SONAME (a Rust cdylib has none by default), so
//! programs linked against it record a versioned dependency.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvclient.so.0");
}
