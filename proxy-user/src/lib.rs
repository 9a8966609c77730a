//! User space of ebpf-proxy: the model of what the maps hold, the writer that keeps them
//! in step, the store over the pinned BPF maps, and the loader. Used by `proxy-agent`,
//! `proxyctl` and the integration tests.

pub mod agent;
pub mod batch;
pub mod bpf;
pub mod cgroup;
pub mod cleanup;
pub mod cluster;
pub mod codec;
pub mod counters;
pub mod ctl;
pub mod ctsize;
pub mod dsr_trust;
pub mod fasthash;
pub mod fs;
pub mod fwd;
pub mod kubeproxy_config;
pub mod loader;
pub mod maglev;
pub mod migrate;
pub mod model;
pub mod node;
pub mod pins;
pub mod podbypass;
pub mod podif;
#[cfg(feature = "prog-run")]
pub mod prog_run;
pub mod sockdestroy;
pub mod socklb;
pub mod store;
pub mod svc_cidr;
pub mod writer;

pub use bpf::BpfMaps;
pub use fwd::ForwardingMode;
pub use loader::{install, uninstall, Acceleration, InstallOptions, TcAttachMode};
pub use model::{Backend, Frontend, Proto, ServiceEntry};
pub use pins::{PinDir, DEFAULT_PIN_PATH};
pub use store::{MapStore, MemStore};
pub use writer::Writer;
