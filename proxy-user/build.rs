//! Builds the eBPF object (`proxy-ebpf`) with the nightly toolchain through aya-build and
//! leaves it in `OUT_DIR/proxy-ebpf` for `include_bytes_aligned!`.
//!
//! Stub switch: when `bpf-linker` is not installed (or `PROXY_EBPF_STUB=1`), an empty
//! object is written instead so `cargo check`/`cargo clippy` work on any machine. A binary
//! built that way refuses to load with a message pointing at `cargo xtask setup`.

use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, Result};

fn main() -> Result<()> {
    println!("cargo:rerun-if-env-changed=PROXY_EBPF_STUB");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out_dir.join("proxy-ebpf");

    let forced = env::var("PROXY_EBPF_STUB").is_ok_and(|v| v == "1" || v == "true");
    let linker = which_bpf_linker();
    if forced || linker.is_none() {
        let why = if forced {
            "PROXY_EBPF_STUB=1"
        } else {
            "bpf-linker not found (run `cargo xtask setup`)"
        };
        println!("cargo:warning=building without the eBPF object: {why}");
        if !forced {
            // Built again once bpf-linker appears: on a new PATH, or installed into
            // `$CARGO_HOME/bin` (where `cargo xtask setup` puts it; the directory's
            // contents change). Without this a stub build stays cached after setup.
            println!("cargo:rerun-if-env-changed=PATH");
            let home = env::var_os("CARGO_HOME")
                .map(PathBuf::from)
                .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
            if let Some(home) = home {
                let bin = home.join("bin");
                if bin.is_dir() {
                    println!("cargo:rerun-if-changed={}", bin.display());
                }
            }
        }
        fs::write(&object, []).context("writing the stub eBPF object")?;
        return Ok(());
    }

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest_dir
        .parent()
        .context("proxy-user has no parent directory")?
        .join("proxy-ebpf");
    let root_dir = ebpf_dir.to_str().context("non-UTF-8 path")?;
    println!("cargo:rerun-if-changed={}", ebpf_dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        manifest_dir.join("../proxy-common/src").display()
    );
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "proxy-ebpf",
            root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}

fn which_bpf_linker() -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join("bpf-linker"))
        .find(|p| p.is_file())
}
