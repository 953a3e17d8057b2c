//! Pageable host memory of its own mapping, for [`SleepMode::Pageable`]
//! (crate::SleepMode::Pageable): an anonymous private mapping (Linux),
//! whose pages become resident as a sleep's copy writes them and go back
//! to the system as a whole when it is dropped (`munmap`), so the
//! process's resident memory falls at the wake, whatever the heap's
//! allocator would have kept. Elsewhere a plain heap buffer. For
//! [`SleepMode::Disk`](crate::SleepMode::Disk), a shared mapping of a file
//! of its own (Linux only), removed when the buffer is dropped.
#![allow(unsafe_code)]

use crate::error::{Error, Result};

/// A host buffer of pageable memory, zero-filled at creation (the kernel's
/// zero pages: nothing is resident until written).
pub(crate) struct PageableBuf {
    #[cfg(target_os = "linux")]
    ptr: std::ptr::NonNull<u8>,
    #[cfg(target_os = "linux")]
    len: usize,
    #[cfg(not(target_os = "linux"))]
    buf: Vec<u8>,
}

// SAFETY: the buffer owns its mapping alone (no alias outlives `&self` or
// `&mut self` borrows), as a `Vec<u8>` owns its heap block.
#[cfg(target_os = "linux")]
unsafe impl Send for PageableBuf {}
// SAFETY: shared references only read, as for `Vec<u8>`.
#[cfg(target_os = "linux")]
unsafe impl Sync for PageableBuf {}

impl PageableBuf {
    /// A buffer of `len` bytes; [`Error::OutOfMemory`] if the system will
    /// not map it.
    pub(crate) fn new(len: usize) -> Result<Self> {
        #[cfg(target_os = "linux")]
        {
            use rustix::mm::{MapFlags, ProtFlags};
            if len == 0 {
                return Ok(Self {
                    ptr: std::ptr::NonNull::dangling(),
                    len: 0,
                });
            }
            // SAFETY: a fresh anonymous mapping at an address the kernel
            // picks: it aliases nothing.
            let p = unsafe {
                rustix::mm::mmap_anonymous(
                    std::ptr::null_mut(),
                    len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE,
                )
            }
            .map_err(|e| mmap_error(e, len))?;
            Ok(Self {
                ptr: std::ptr::NonNull::new(p.cast()).expect("mmap returned null"),
                len,
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            let mut buf = Vec::new();
            buf.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
                call: "malloc",
                requested_bytes: len,
            })?;
            buf.resize(len, 0);
            Ok(Self { buf })
        }
    }

    /// A buffer of `len` bytes in a new file of `dir`, mapped shared: what
    /// is written goes to the file (through the page cache, which the
    /// system may write back and evict). The file is private from the
    /// start and never outlives the process: made without a name
    /// (`O_TMPFILE`), or where the file system cannot, under a random
    /// name unlinked at once (a name taken first is passed over); mode
    /// 0600 either way. Its space is allocated at once, so a full disk is
    /// an error here rather than a fault in the copy: [`Error::Spill`]
    /// (naming the directory and the bytes) for any failure to make it;
    /// [`Error::Unsupported`] outside Linux.
    pub(crate) fn in_file(dir: &std::path::Path, len: usize) -> Result<Self> {
        #[cfg(target_os = "linux")]
        {
            use rustix::mm::{MapFlags, ProtFlags};
            let spill = |e: rustix::io::Errno| Error::Spill {
                dir: dir.to_path_buf(),
                bytes: len,
                source: e.into(),
            };
            let fd = private_file(dir).map_err(spill)?;
            rustix::fs::ftruncate(&fd, len as u64).map_err(spill)?;
            rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len as u64)
                .map_err(spill)?;
            if len == 0 {
                return Ok(Self {
                    ptr: std::ptr::NonNull::dangling(),
                    len: 0,
                });
            }
            // SAFETY: a fresh shared mapping of a file only this process
            // can reach, at an address the kernel picks: it aliases no
            // Rust memory. The mapping keeps the file alive after `fd`
            // closes.
            let p = unsafe {
                rustix::mm::mmap(
                    std::ptr::null_mut(),
                    len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED,
                    &fd,
                    0,
                )
            }
            .map_err(|e| mmap_error(e, len))?;
            Ok(Self {
                ptr: std::ptr::NonNull::new(p.cast()).expect("mmap returned null"),
                len,
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (dir, len);
            Err(Error::Unsupported {
                what: "backups in files (built on Linux only)".into(),
            })
        }
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        #[cfg(target_os = "linux")]
        // SAFETY: `len` bytes mapped readable at `ptr` (or none, dangling
        // but aligned), owned by `self` for the borrow.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr(), self.len)
        }
        #[cfg(not(target_os = "linux"))]
        &self.buf
    }

    /// The bytes, to write.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        #[cfg(target_os = "linux")]
        // SAFETY: as in `as_slice`, mapped writable, and `&mut self`
        // excludes every other reference.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
        }
        #[cfg(not(target_os = "linux"))]
        &mut self.buf
    }

    /// The first byte's host address.
    pub(crate) fn address(&self) -> u64 {
        self.as_slice().as_ptr() as u64
    }

    /// The buffer's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.as_slice().len()
    }
}

#[cfg(target_os = "linux")]
impl Drop for PageableBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `new` or `in_file`, which nothing
            // borrows any more.
            if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
                tracing::warn!(error = %e, bytes = self.len, "vmmbuf: munmap of a pageable backup failed");
            }
        }
    }
}

/// A new file of `dir` that no other process can open or name: unnamed
/// (`O_TMPFILE`), or, on a file system without it, created under a random
/// name (`O_EXCL`: a name someone made first is passed over) and unlinked
/// before it is used. Mode 0600.
#[cfg(target_os = "linux")]
fn private_file(dir: &std::path::Path) -> rustix::io::Result<rustix::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    use rustix::io::Errno;
    let mode = Mode::from_raw_mode(0o600);
    match rustix::fs::open(dir, OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC, mode) {
        Ok(fd) => return Ok(fd),
        // Not supported by this file system (or kernel): a named file.
        Err(Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL) => {}
        Err(e) => return Err(e),
    }
    for n in 0..64u32 {
        // The standard library's hasher keys come from the OS's randomness.
        let r =
            std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), n);
        let path = dir.join(format!("vmmbuf-{r:016x}.bak"));
        match rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        ) {
            Ok(fd) => {
                rustix::fs::unlink(&path)?;
                return Ok(fd);
            }
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EXIST)
}

/// `mmap`'s error as the crate's: out of memory, or the system's cause.
#[cfg(target_os = "linux")]
fn mmap_error(e: rustix::io::Errno, len: usize) -> Error {
    if e == rustix::io::Errno::NOMEM {
        Error::OutOfMemory {
            call: "mmap",
            requested_bytes: len,
        }
    } else {
        Error::Os {
            call: "mmap",
            source: e.into(),
        }
    }
}

impl std::fmt::Debug for PageableBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageableBuf({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::PageableBuf;

    /// Zero-filled, writable, read back as written; empty buffers too.
    #[test]
    fn a_buffer_holds_what_is_written() {
        let mut b = PageableBuf::new(3 << 20).unwrap();
        assert!(b.as_slice().iter().step_by(4093).all(|&x| x == 0));
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        assert!(b
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 251) as u8));
        assert_eq!(b.len(), 3 << 20);
        let e = PageableBuf::new(0).unwrap();
        assert_eq!(e.len(), 0);
    }

    /// A file-backed buffer holds what is written, and leaves nothing in
    /// its directory, not even while it lives (a killed process leaves no
    /// file behind); a directory that does not exist is a typed error
    /// naming it and the bytes.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_buffer_leaves_no_file_behind() {
        let dir = std::env::temp_dir().join(format!("vmmbuf-pages-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = PageableBuf::in_file(&dir, 1 << 20).unwrap();
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 253) as u8;
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no name");
        assert_eq!(b.len(), 1 << 20);
        assert!(b
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 253) as u8));
        drop(b);
        let missing = dir.join("missing");
        match PageableBuf::in_file(&missing, 4096) {
            Err(crate::Error::Spill { dir: d, bytes, .. }) => {
                assert_eq!((d, bytes), (missing, 4096))
            }
            other => panic!("expected a spill error, got {other:?}"),
        }
        std::fs::remove_dir(&dir).unwrap();
    }
}
