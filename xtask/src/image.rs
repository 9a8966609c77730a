//! `cargo xtask image`: the shipped image, built from `deploy/Dockerfile` with buildah.
//!
//! No container registry is needed: the Dockerfile's `BASE` is a Debian bookworm made
//! here with `debootstrap --variant=minbase` from the machine's Debian mirror (cached as
//! `target/image/debian-bookworm-minbase.tar`, imported once as [`LOCAL_BASE`]), and its
//! `BINARIES` a local image holding the release binaries built on the host (`cargo xtask
//! build`) at the builder stage's paths, so the builder stage (which needs `rust:1-bookworm`
//! from a registry) is skipped. With `--base debian:bookworm-slim` (a registry reachable),
//! the same Dockerfile builds on the registry's base. Prints the image's size (as stored,
//! uncompressed, and gzip-compressed as `podman save` writes it) and its digest.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{release_dir, run, setup, workspace_root};

/// The image built, in the local containers storage.
pub const IMAGE: &str = "localhost/ebpf-proxy:dev";
/// The locally made Debian base.
pub const LOCAL_BASE: &str = "localhost/ebpf-proxy-base:bookworm";
/// The host-built binaries, at the builder stage's paths.
const BINARIES: &str = "localhost/ebpf-proxy-binaries:dev";
/// Where the builder stage leaves the binaries (deploy/Dockerfile).
const BUILDER_RELEASE: &str = "/home/build/src/target/release";

#[derive(clap::Args, Default)]
pub struct Args {
    /// The Dockerfile's BASE: an image from a registry (e.g. `debian:bookworm-slim`).
    /// Default: a Debian bookworm made here with debootstrap (no registry needed).
    #[arg(long)]
    base: Option<String>,
}

pub fn main(args: Args) -> Result<()> {
    if !setup::is_root() {
        bail!("cargo xtask image: buildah's storage and debootstrap need root");
    }
    setup::apt_packages(setup::IMAGE_APT_PACKAGES)?;
    crate::build()?;
    let work = release_dir()
        .parent()
        .context("the target directory")?
        .join("image");
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let base = match args.base {
        Some(base) => base,
        None => {
            local_base(&work)?;
            LOCAL_BASE.to_owned()
        }
    };
    binaries_image(&work)?;

    // Nothing is copied from the context on this path (the binaries come from BINARIES):
    // an empty one keeps the repository and target/ out of buildah's view.
    let context = work.join("context");
    fs::create_dir_all(&context)?;
    run(Command::new("buildah")
        .args(["bud", "--isolation", "chroot", "--layers"])
        .arg("-f")
        .arg(workspace_root().join("deploy/Dockerfile"))
        .args(["--build-arg", &format!("BASE={base}")])
        .args(["--build-arg", &format!("BINARIES={BINARIES}")])
        .args(["-t", IMAGE])
        .arg(&context))?;
    // buildah 1.28 leaves a working container for a stage that is only a FROM (BINARIES).
    if let Ok(out) = Command::new("buildah")
        .args(["containers", "--format", "{{.ContainerName}}"])
        .output()
    {
        for name in String::from_utf8_lossy(&out.stdout).lines() {
            if name.starts_with("ebpf-proxy-binaries-working-container") {
                let _ = Command::new("buildah").args(["rm", name]).output();
            }
        }
    }
    report(&work)
}

/// `LOCAL_BASE` in the containers storage: imported from the cached tar, made first with
/// debootstrap when there is none.
fn local_base(work: &Path) -> Result<()> {
    if quiet(Command::new("buildah").args(["inspect", "--type", "image", LOCAL_BASE])) {
        eprintln!("image: base {LOCAL_BASE} already in the local storage");
        return Ok(());
    }
    let tar = work.join("debian-bookworm-minbase.tar");
    if !tar.is_file() {
        let rootfs = work.join("rootfs");
        if rootfs.exists() {
            fs::remove_dir_all(&rootfs)
                .with_context(|| format!("removing a stale {}", rootfs.display()))?;
        }
        let mirror = debian_mirror();
        run(Command::new("debootstrap")
            .args(["--variant=minbase", "bookworm"])
            .arg(&rootfs)
            .arg(&mirror))?;
        // As debian:*-slim: no package lists, caches, documentation or translations.
        for dir in [
            "var/cache/apt",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/info",
            "usr/share/locale",
            "var/log",
        ] {
            let path = rootfs.join(dir);
            if path.exists() {
                for entry in fs::read_dir(&path)? {
                    let entry = entry?.path();
                    if entry.is_dir() {
                        fs::remove_dir_all(&entry)?;
                    } else {
                        fs::remove_file(&entry)?;
                    }
                }
            }
        }
        let partial = work.join("debian-bookworm-minbase.tar.partial");
        run(Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&partial)
            .arg("."))?;
        fs::rename(&partial, &tar)?;
        fs::remove_dir_all(&rootfs)?;
    }
    run(Command::new("podman")
        .arg("import")
        .args(["--change", "CMD [\"/bin/bash\"]"])
        .arg(&tar)
        .arg(LOCAL_BASE))
}

/// The first Debian mirror in the machine's apt sources (deb822 `URIs:` or a one-line
/// `deb URL bookworm`), else deb.debian.org.
fn debian_mirror() -> String {
    let mut texts = Vec::new();
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            if path
                .extension()
                .is_some_and(|e| e == "sources" || e == "list")
            {
                texts.extend(fs::read_to_string(path));
            }
        }
    }
    texts.extend(fs::read_to_string("/etc/apt/sources.list"));
    for text in &texts {
        for line in text.lines() {
            let url = line
                .strip_prefix("URIs:")
                .and_then(|u| u.split_whitespace().next())
                .or_else(|| {
                    line.strip_prefix("deb ")
                        .and_then(|l| l.split_whitespace().find(|w| w.contains("://")))
                });
            if let Some(url) = url.filter(|u| u.ends_with("/debian") || u.ends_with("/debian/")) {
                return url.to_owned();
            }
        }
    }
    "http://deb.debian.org/debian".to_owned()
}

/// `BINARIES`: an image from scratch with the host's release binaries.
fn binaries_image(work: &Path) -> Result<()> {
    let out = Command::new("buildah")
        .args(["from", "scratch"])
        .output()
        .context("buildah from scratch")?;
    if !out.status.success() {
        bail!(
            "buildah from scratch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let container = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let result = (|| {
        for bin in ["proxy-agent", "proxyctl"] {
            // Stripped of the symbol table, as the Dockerfile's builder does.
            let stripped = work.join(bin);
            fs::copy(release_dir().join(bin), &stripped)
                .with_context(|| format!("copying {bin}"))?;
            run(Command::new("strip").arg(&stripped))?;
            run(Command::new("buildah")
                .arg("copy")
                .arg(&container)
                .arg(&stripped)
                .arg(format!("{BUILDER_RELEASE}/{bin}")))?;
            let _ = fs::remove_file(&stripped);
        }
        run(Command::new("buildah").args(["commit", "--quiet", &container, BINARIES]))
    })();
    let _ = Command::new("buildah").args(["rm", &container]).output();
    result
}

fn report(work: &Path) -> Result<()> {
    let out = Command::new("podman")
        .args([
            "image",
            "inspect",
            "--format",
            "{{.Size}} {{.Digest}}",
            IMAGE,
        ])
        .output()
        .context("podman image inspect")?;
    if !out.status.success() {
        bail!(
            "podman image inspect {IMAGE}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace();
    let size: u64 = fields
        .next()
        .and_then(|s| s.parse().ok())
        .context("image size")?;
    let digest = fields.next().unwrap_or("?").to_owned();
    let archive = work.join("ebpf-proxy-image.tar");
    let _ = fs::remove_file(&archive);
    run(Command::new("podman")
        .args(["save", "--format", "docker-archive", "-o"])
        .arg(&archive)
        .arg(IMAGE))?;
    let gz = Command::new("sh")
        .arg("-c")
        .arg("gzip -c \"$1\" | wc -c")
        .arg("sh")
        .arg(&archive)
        .output()
        .context("gzip")?;
    let compressed: u64 = String::from_utf8_lossy(&gz.stdout)
        .trim()
        .parse()
        .context("compressed size")?;
    let _ = fs::remove_file(&archive);
    let mb = |b: u64| b as f64 / 1e6;
    println!("image {IMAGE}");
    println!("  digest       {digest}");
    println!("  size         {:.1} MB uncompressed", mb(size));
    println!(
        "  compressed   {:.1} MB (gzip of `podman save`)",
        mb(compressed)
    );
    Ok(())
}

/// Runs `cmd` without output; whether it succeeded.
fn quiet(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
