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
    /// The file behind a file-backed buffer, removed at the drop.
    #[cfg(target_os = "linux")]
    file: Option<std::path::PathBuf>,
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
                    file: None,
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
                file: None,
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

    /// A buffer of `len` bytes in a new file of `dir` (named
    /// `vmmbuf-<pid>-<n>.bak`), mapped shared: what is written goes to the
    /// file (through the page cache, which the system may write back and
    /// evict), and the file is removed when the buffer is dropped.
    /// [`Error::Os`] if the file cannot be made or mapped (a full disk
    /// too); [`Error::Unsupported`] outside Linux.
    pub(crate) fn in_file(dir: &std::path::Path, len: usize) -> Result<Self> {
        #[cfg(target_os = "linux")]
        {
            use rustix::fs::{Mode, OFlags};
            use rustix::mm::{MapFlags, ProtFlags};
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = dir.join(format!("vmmbuf-{}-{n}.bak", std::process::id()));
            let os = |call: &'static str| {
                move |e: rustix::io::Errno| Error::Os {
                    call,
                    source: e.into(),
                }
            };
            let fd = rustix::fs::open(
                &path,
                OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
            .map_err(os("open"))?;
            // The file goes with the buffer; until the buffer exists, an
            // error removes it here.
            let made = (|| {
                rustix::fs::ftruncate(&fd, len as u64).map_err(os("ftruncate"))?;
                // Space for every byte now, so that a full disk is an error
                // here rather than a fault in the copy.
                rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len as u64)
                    .map_err(os("fallocate"))?;
                if len == 0 {
                    return Ok(std::ptr::NonNull::dangling());
                }
                // SAFETY: a fresh shared mapping of a file this process just
                // created, at an address the kernel picks: it aliases no
                // Rust memory.
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
                Ok(std::ptr::NonNull::new(p.cast()).expect("mmap returned null"))
            })();
            match made {
                Ok(ptr) => Ok(Self {
                    ptr,
                    len,
                    file: Some(path),
                }),
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    Err(e)
                }
            }
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
        if let Some(path) = self.file.take() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(error = %e, path = %path.display(), "vmmbuf: removing a backup file failed");
            }
        }
    }
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

    /// A file-backed buffer is a file of the directory, of its length, that
    /// holds what is written, removed at the drop; a directory that does
    /// not exist is an error that leaves nothing.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_buffer_is_a_file_until_dropped() {
        let dir = std::env::temp_dir().join(format!("vmmbuf-pages-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut b = PageableBuf::in_file(&dir, 1 << 20).unwrap();
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 253) as u8;
        }
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1);
        let on_disk = std::fs::read(&files[0]).unwrap();
        assert_eq!(on_disk.len(), 1 << 20);
        assert!(on_disk
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 253) as u8));
        drop(b);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "removed");
        assert!(PageableBuf::in_file(&dir.join("missing"), 4096).is_err());
        std::fs::remove_dir(&dir).unwrap();
    }
}
