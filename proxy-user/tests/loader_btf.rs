//! The loader must not read the kernel's BTF for an object that does not need it.
//!
//! aya 0.14.0's `EbpfLoader::new()` read and parsed `/sys/kernel/btf/vmlinux` (5.5 MB here,
//! an 18.6 MB heap peak) before the caller could say `.btf(None)`: the agent's whole
//! start-up heap peak at 100 Services. The workspace patches aya
//! (`proxy-user/patched/aya/PATCHED.md`); this fails if the patch is lost, e.g. when the
//! `[patch.crates-io]` entry is dropped without moving to an aya that has the fix.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts the bytes allocated on this process's heap, to tell a parse from no parse.
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.load(Ordering::Relaxed);
    let out = f();
    (out, ALLOCATED.load(Ordering::Relaxed) - before)
}

#[test]
fn making_a_loader_does_not_parse_the_kernel_btf() {
    // Without the kernel's BTF on this machine the test could not tell a parse from none.
    let size = std::fs::metadata(KERNEL_BTF)
        .unwrap_or_else(|e| panic!("{KERNEL_BTF}: {e} (the test needs the kernel's BTF)"))
        .len();
    // The control: what parsing it costs, so the bound below is known to separate the two.
    let (btf, parse) = allocated_by(aya::Btf::from_sys_fs);
    btf.unwrap_or_else(|e| panic!("parsing {KERNEL_BTF}: {e}"));
    assert!(
        parse as u64 >= size,
        "parsing {size} bytes of BTF allocated only {parse} bytes: the control does not hold"
    );
    let (loader, made) = allocated_by(aya::EbpfLoader::new);
    drop(loader);
    assert!(
        made < 64 * 1024,
        "EbpfLoader::new() allocated {made} bytes (a parse of {KERNEL_BTF} allocates {parse}): \
         the patched aya of proxy-user/patched/aya is not in use"
    );
}
