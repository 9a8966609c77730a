//! The per-Service maps' keys and values: frontends (`SVC4/6`), backends (`BACKEND4/6`),
//! reverse NAT (`REVNAT4/6`), source ranges (`SRC_RANGE4/6`), Maglev tables (`MAGLEV`).

use crate::limits;

/// Bytes of a service name kept in `REVNAT` values (`namespace/name:port`, truncated).
pub const NAME_LEN: usize = 64;

/// `SVC4` key. `port` is in network byte order, `addr` as the 4 bytes of the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Svc4Key {
    pub addr: u32,
    pub port: u16,
    /// 0 for the frontend entry (which holds slots `1..=SVC_CHUNK_SLOTS`), `c >= 1` for
    /// the chunk of slots `c * SVC_CHUNK_SLOTS + 1 ..= (c + 1) * SVC_CHUNK_SLOTS`.
    pub chunk: u16,
    pub proto: u8,
    /// `scope::ALL` or `scope::EXTERNAL_LOCAL`.
    pub scope: u8,
    pub _pad: [u8; 2],
}

/// `SVC6` key; the address as four network-order words, as in `bpf_sock_addr.user_ip6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Svc6Key {
    pub addr: [u32; 4],
    pub port: u16,
    pub chunk: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}

/// Backend slots held by one `SVC4`/`SVC6` entry: the frontend entry (chunk 0) holds
/// slots `1..=24`, chunk `c` slots `24c + 1 ..= 24c + 24`. 24 fills the kernel's 192-byte
/// allocation class for a hash element of either family (`docs/deploy.md`): most Services
/// cost one element for their frontend and all its slots, not one per slot.
pub const SVC_CHUNK_SLOTS: usize = 24;

/// The chunk holding backend slot `slot` (`1..=count`) and the slot's index in it.
#[inline(always)]
pub const fn svc_chunk_of(slot: u16) -> (u16, usize) {
    let i = slot.wrapping_sub(1) as usize;
    ((i / SVC_CHUNK_SLOTS) as u16, i % SVC_CHUNK_SLOTS)
}

/// The frontend's fields of an `SVC4`/`SVC6` entry (chunk 0): `count`, `service_id`,
/// `flags`, `affinity_timeout`. In a chunk `c >= 1`: `service_id` only (for dumps).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcValue {
    pub service_id: u32,
    pub count: u16,
    pub flags: u16,
    /// Session affinity timeout in seconds (0: no affinity).
    pub affinity_timeout: u32,
}

/// `SVC4`/`SVC6` value: the frontend's fields and the backend ids of one chunk of its
/// slots (0 past the count).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcEntry {
    pub head: SvcValue,
    pub backends: [u32; SVC_CHUNK_SLOTS],
}

impl SvcEntry {
    /// The backend id of the slot at index `i` of this chunk, if it names one.
    #[inline(always)]
    pub fn backend_at(&self, i: usize) -> Option<u32> {
        match self.backends.get(i) {
            Some(&id) if id != 0 => Some(id),
            _ => None,
        }
    }
}

/// `BACKEND4` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend4 {
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

impl Backend4 {
    /// The entry of a free id (`BACKEND4` is an array: "deleting" writes it).
    pub const FREE: Self = Self {
        addr: 0,
        port: 0,
        proto: 0,
        flags: 0,
    };

    /// Whether the id holds a backend: every backend written has a protocol (6, 17,
    /// 132); protocol 0 is a free id's entry (never written, or freed).
    #[inline(always)]
    pub fn in_use(&self) -> bool {
        self.proto != 0
    }
}

/// `BACKEND6` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

impl Backend6 {
    /// The entry of a free id ([`Backend4::FREE`]).
    pub const FREE: Self = Self {
        addr: [0; 4],
        port: 0,
        proto: 0,
        flags: 0,
    };

    /// Whether the id holds a backend ([`Backend4::in_use`]).
    #[inline(always)]
    pub fn in_use(&self) -> bool {
        self.proto != 0
    }
}

/// `REVNAT4` value (key: service id): the frontend and, for the CLI, the Service's
/// name (`namespace/name:port`, NUL-padded).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevNat4 {
    pub addr: u32,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub name: [u8; NAME_LEN],
}

/// `REVNAT6` value (key: service id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevNat6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
    pub name: [u8; NAME_LEN],
}

/// `SRC_RANGE4` LPM key data (after the 4-byte prefix length): service id, then the
/// address; the prefix length counts 32 bits of service id plus the address prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRange4 {
    pub service_id: u32,
    pub addr: u32,
}

/// `SRC_RANGE6` LPM key data.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRange6 {
    pub service_id: u32,
    pub addr: [u32; 4],
}

impl Svc4Key {
    /// The key of chunk `chunk` of frontend `addr:port/proto` in `scope`.
    pub const fn new(addr: u32, port: u16, proto: u8, scope: u8, chunk: u16) -> Self {
        Self {
            addr,
            port,
            chunk,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

impl Svc6Key {
    /// The key of chunk `chunk` of frontend `addr:port/proto` in `scope`.
    pub const fn new(addr: [u32; 4], port: u16, proto: u8, scope: u8, chunk: u16) -> Self {
        Self {
            addr,
            port,
            chunk,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
}

/// `MAGLEV` key: one chunk of the table of the frontend with `service_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub service_id: u32,
    /// Chunk number: slots `chunk * MAGLEV_CHUNK_SLOTS ..` of the table.
    pub chunk: u32,
}

/// `MAGLEV` value: `MAGLEV_CHUNK_SLOTS` entries of a table of `table_size` entries, each
/// a backend slot (`1..=count` of the frontend; 0 past the table's end).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevChunk {
    /// M, the whole table's size (the same in every chunk of a table).
    pub table_size: u32,
    pub _pad: u32,
    pub slots: [u16; limits::MAGLEV_CHUNK_SLOTS],
}
