//! `proxyctl`: shows what the ebpf-proxy datapath does, from the pinned maps (read-only).
//! Everything lives in `proxy_user::ctl`; see docs/proxyctl.md.

fn main() -> std::process::ExitCode {
    proxy_user::ctl::main()
}
