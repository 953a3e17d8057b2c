//! A test-only backend that wraps a real one and fails its k-th driver call.
//! A failed call does nothing (as a driver call that errors out); a token
//! handed to a failed `release` or `free` is dropped, whose own `Drop` then
//! gives the resource back, as the `Backend` contract says.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use vmmbuf::{stats::LiveCounts, AccessDesc, Backend, Error, Location, Result};

/// A fence the test opens by hand, to drive stream-ordered release on any
/// backend; a broken one answers every query with an error.
#[derive(Clone, Default)]
pub struct TestFence(pub Arc<AtomicBool>, pub Arc<AtomicBool>);

impl TestFence {
    pub fn pass(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn passed() -> Self {
        let f = Self::default();
        f.pass();
        f
    }
    pub fn break_it(&self) {
        self.1.store(true, Ordering::SeqCst);
    }
}

/// A stream of the emulated GPU (`FaultBackend::emulating_gpu`) whose work
/// has always finished: its fences have passed when made.
#[derive(Clone)]
pub struct DoneStream(pub u64);

impl<B: Backend> vmmbuf::ArenaStream<FaultBackend<B>> for DoneStream {
    fn key(&self) -> (u64, u64) {
        (0, self.0)
    }
    fn fence(&self, _: &FaultBackend<B>) -> Result<TestFence> {
        Ok(TestFence::passed())
    }
}

/// The stand-in fabric: handle bytes -> the descriptor they name.
static FABRIC: parking_lot::Mutex<std::collections::BTreeMap<[u8; 64], std::os::fd::OwnedFd>> =
    parking_lot::Mutex::new(std::collections::BTreeMap::new());
static FABRIC_NEXT: AtomicUsize = AtomicUsize::new(1);

/// Fabric handles the stand-in fabric has handed out so far.
pub fn fabric_handles_made() -> usize {
    FABRIC_NEXT.load(Ordering::SeqCst) - 1
}

pub struct FaultBackend<B> {
    pub inner: Arc<B>,
    calls: AtomicUsize,
    /// Fence queries (`fence_done`) so far: not counted in `calls`.
    queries: AtomicUsize,
    /// Device synchronisations so far (the host backend counts none):
    /// reported as `live().device_syncs`.
    syncs: AtomicUsize,
    fail_at: AtomicUsize,
    failed: AtomicUsize,
    /// Every call of this name, from this call number on, fails until
    /// disarmed (a second fault).
    sticky: parking_lot::Mutex<Option<(&'static str, usize)>>,
    /// Pretend to be GPU 0 with host placement beside it (see `emulating_gpu`).
    emulate_gpu: bool,
    /// The maps `(address, chunk bytes)`, access calls and unmaps
    /// `(address, bytes)` that succeeded, in order, named; tests add their
    /// own events (a map hook's calls).
    pub log: parking_lot::Mutex<Vec<(&'static str, u64, usize)>>,
    /// Each chunk's bytes by its id (for the log's maps).
    sizes: parking_lot::Mutex<std::collections::HashMap<u64, usize>>,
    /// Export and import fabric handles: 64 bytes naming a descriptor this
    /// process keeps ([`FABRIC`]), a stand-in for an NVLink fabric between
    /// backends of one process.
    pub fabric: AtomicBool,
    /// The device's `(free, total)` bytes this backend reports
    /// (`device_memory`); None: the inner backend's.
    pub device_free: parking_lot::Mutex<Option<(usize, usize)>>,
    /// Called at each `wait`, before the fence is looked at: a test's model
    /// of the GPU catching up while the CPU waits (the lag replay).
    #[allow(clippy::type_complexity)]
    pub on_wait: parking_lot::Mutex<Option<Box<dyn Fn(&TestFence) + Send + Sync>>>,
}

impl<B: Backend> FaultBackend<B> {
    pub fn new(inner: Arc<B>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: AtomicUsize::new(0),
            queries: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            fail_at: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            sticky: parking_lot::Mutex::new(None),
            emulate_gpu: false,
            log: parking_lot::Mutex::new(Vec::new()),
            sizes: parking_lot::Mutex::new(std::collections::HashMap::new()),
            fabric: AtomicBool::new(false),
            device_free: parking_lot::Mutex::new(None),
            on_wait: parking_lot::Mutex::new(None),
        })
    }

    /// Over the host backend, a backend that behaves as GPU 0 with host
    /// placement beside it: `Device(0)` is home, chunks of either placement
    /// are host memory, and GPU 0's access in an access list is what the
    /// (host) mapping gets, since copies here stand for the GPU's. Placement,
    /// migration and per-chunk access then run, and fail, without a GPU.
    pub fn emulating_gpu(inner: Arc<B>) -> Arc<Self> {
        let mut b = Arc::into_inner(Self::new(inner)).expect("fresh");
        b.emulate_gpu = true;
        Arc::new(b)
    }

    /// Fail every call named `call` (`"unmap"`, `"map"`, ...) until
    /// `fail_every(None)`.
    pub fn fail_every(&self, call: Option<&'static str>) {
        *self.sticky.lock() = call.map(|c| (c, 0));
    }

    /// Fail every call named `call` from the `k`-th call from now on.
    pub fn fail_every_from(&self, k: usize, call: &'static str) {
        let now = self.calls.load(Ordering::SeqCst);
        *self.sticky.lock() = Some((call, now + k));
    }

    /// Fail the `k`-th call from now (1-based); 0 disarms.
    pub fn fail_nth(&self, k: usize) {
        let now = self.calls.load(Ordering::SeqCst);
        self.fail_at
            .store(if k == 0 { 0 } else { now + k }, Ordering::SeqCst);
    }

    /// Calls made so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Fence queries (`fence_done`) so far.
    pub fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }

    /// Faults injected so far.
    pub fn injected(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }

    fn step(&self, call: &'static str, bytes: usize) -> Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let sticky = matches!(*self.sticky.lock(), Some((c, from)) if c == call && n >= from);
        if n == self.fail_at.load(Ordering::SeqCst) || sticky {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(if call == "create" {
                Error::OutOfMemory {
                    call: "injected create",
                    requested_bytes: bytes,
                }
            } else {
                // A code no real call of these returns: plainly injected.
                Error::Driver {
                    call,
                    source: cudarc::driver::DriverError(
                        cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_PERMITTED,
                    ),
                }
            });
        }
        Ok(())
    }
}

impl<B: Backend> Backend for FaultBackend<B> {
    type Reservation = B::Reservation;
    type Chunk = B::Chunk;
    type Fence = TestFence;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn home(&self) -> Location {
        if self.emulate_gpu {
            Location::Device(0)
        } else {
            self.inner.home()
        }
    }
    fn granularity(&self, placement: Location) -> Result<usize> {
        self.inner.granularity(self.placed(placement)?)
    }
    fn reserve(&self, bytes: usize, align: usize) -> Result<Self::Reservation> {
        self.step("reserve", bytes)?;
        self.inner.reserve(bytes, align)
    }
    fn base(&self, res: &Self::Reservation) -> u64 {
        self.inner.base(res)
    }
    fn free(&self, res: Self::Reservation) -> Result<()> {
        self.step("free", 0)?;
        self.inner.free(res)
    }
    fn create(&self, bytes: usize, placement: Location) -> Result<Self::Chunk> {
        self.step("create", bytes)?;
        let c = self.inner.create(bytes, self.placed(placement)?)?;
        self.sizes.lock().insert(self.inner.chunk_id(&c), bytes);
        Ok(c)
    }
    fn release(&self, chunk: Self::Chunk) -> Result<()> {
        self.step("release", 0)?;
        self.inner.release(chunk)
    }
    fn create_shareable(&self, bytes: usize, placement: Location) -> Result<Self::Chunk> {
        self.step("create", bytes)?;
        let c = self
            .inner
            .create_shareable(bytes, self.placed(placement)?)?;
        self.sizes.lock().insert(self.inner.chunk_id(&c), bytes);
        Ok(c)
    }
    fn is_shareable(&self, chunk: &Self::Chunk) -> bool {
        self.inner.is_shareable(chunk)
    }
    fn export(&self, chunk: &Self::Chunk) -> Result<std::os::fd::OwnedFd> {
        self.step("export", 0)?;
        self.inner.export(chunk)
    }
    fn device_memory(&self) -> Option<(usize, usize)> {
        (*self.device_free.lock()).or_else(|| self.inner.device_memory())
    }
    fn export_handle(
        &self,
        chunk: &Self::Chunk,
        kind: vmmbuf::ipc::HandleKind,
    ) -> Result<vmmbuf::ipc::ChunkHandle> {
        use vmmbuf::ipc::{ChunkHandle, FabricHandle, HandleKind};
        self.step("export", 0)?;
        if kind != HandleKind::Fabric || !self.fabric.load(Ordering::SeqCst) {
            return self.inner.export_handle(chunk, kind);
        }
        let fd = self.inner.export(chunk)?;
        let n = FABRIC_NEXT.fetch_add(1, Ordering::SeqCst) as u64;
        let mut token = [0u8; 64];
        token[..8].copy_from_slice(b"fakefab!");
        token[8..16].copy_from_slice(&n.to_le_bytes());
        FABRIC.lock().insert(token, fd);
        Ok(ChunkHandle::Fabric(FabricHandle(token)))
    }
    fn import_handle(
        &self,
        handle: vmmbuf::ipc::ChunkHandle,
        bytes: usize,
        placement: Location,
    ) -> Result<Self::Chunk> {
        use vmmbuf::ipc::ChunkHandle;
        match handle {
            ChunkHandle::Fabric(h) if self.fabric.load(Ordering::SeqCst) => {
                self.step("import", bytes)?;
                // Each handle names one descriptor; importing takes a copy
                // (a fabric handle may be imported more than once).
                let fd = FABRIC
                    .lock()
                    .get(&h.0)
                    .map(|fd| fd.try_clone())
                    .transpose()
                    .map_err(|e| Error::Protocol {
                        reason: format!("dup: {e}"),
                    })?
                    .ok_or_else(|| Error::Protocol {
                        reason: format!("no such fabric handle {h:?}"),
                    })?;
                self.inner.import(fd, bytes, self.placed(placement)?)
            }
            ChunkHandle::PosixFd(fd) => self.import(fd, bytes, placement),
            other => self.inner.import_handle(other, bytes, placement),
        }
    }
    fn import(
        &self,
        fd: std::os::fd::OwnedFd,
        bytes: usize,
        placement: Location,
    ) -> Result<Self::Chunk> {
        self.step("import", bytes)?;
        self.inner.import(fd, bytes, self.placed(placement)?)
    }
    fn chunk_id(&self, chunk: &Self::Chunk) -> u64 {
        self.inner.chunk_id(chunk)
    }
    fn map(&self, res: &mut Self::Reservation, offset: usize, chunk: &Self::Chunk) -> Result<()> {
        self.step("map", 0)?;
        self.inner.map(res, offset, chunk)?;
        let at = self.inner.base(res) + offset as u64;
        // The chunk's bytes where this backend made it (0 if imported).
        let bytes = self
            .sizes
            .lock()
            .get(&self.inner.chunk_id(chunk))
            .copied()
            .unwrap_or(0);
        self.log.lock().push(("map", at, bytes));
        Ok(())
    }
    fn unmap(&self, res: &mut Self::Reservation, offset: usize, bytes: usize) -> Result<()> {
        self.step("unmap", bytes)?;
        self.inner.unmap(res, offset, bytes)?;
        let at = self.inner.base(res) + offset as u64;
        self.log.lock().push(("unmap", at, bytes));
        Ok(())
    }
    fn set_access(
        &self,
        res: &mut Self::Reservation,
        offset: usize,
        bytes: usize,
        access: &[AccessDesc],
    ) -> Result<()> {
        self.step("set_access", bytes)?;
        if self.emulate_gpu {
            let gpu = access
                .iter()
                .find(|d| d.location == Location::Device(0))
                .map_or(vmmbuf::Access::None, |d| d.access);
            let host = [AccessDesc::new(Location::Host, gpu)];
            self.inner.set_access(res, offset, bytes, &host)?;
        } else {
            self.inner.set_access(res, offset, bytes, access)?;
        }
        let at = self.inner.base(res) + offset as u64;
        self.log.lock().push(("access", at, bytes));
        Ok(())
    }
    fn capture_underway(&self) -> bool {
        self.inner.capture_underway()
    }
    fn synchronize(&self) -> Result<()> {
        self.step("synchronize", 0)?;
        self.inner.synchronize()?;
        self.syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn copy(
        &self,
        dst: &mut Self::Reservation,
        dst_offset: usize,
        src: &Self::Reservation,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        self.step("copy", bytes)?;
        self.inner.copy(dst, dst_offset, src, src_offset, bytes)
    }
    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool> {
        if self.emulate_gpu {
            return Ok(device == 0 && peer == 0);
        }
        self.inner.can_access_peer(device, peer)
    }
    fn wait(&self, fence: &TestFence) -> Result<()> {
        self.step("wait", 0)?;
        if let Some(f) = self.on_wait.lock().as_ref() {
            f(fence);
        }
        match self.fence_done(fence)? {
            true => Ok(()),
            // A test that waits on a fence it never opens would hang a GPU.
            false => Err(Error::InvalidArgument(
                "waited on a test fence that never passes".into(),
            )),
        }
    }
    fn fence_key(&self, fence: &TestFence) -> (u64, u64) {
        (Arc::as_ptr(&fence.0) as u64, 0)
    }
    fn wait_copies(&self) -> Result<()> {
        self.step("wait_copies", 0)?;
        self.inner.wait_copies()
    }
    fn maps_a_chunk_twice(&self) -> bool {
        self.inner.maps_a_chunk_twice()
    }
    fn copies_fence(&self) -> Result<TestFence> {
        self.step("copies_fence", 0)?;
        self.inner.wait_copies()?;
        Ok(TestFence::passed())
    }
    fn fence_done(&self, fence: &TestFence) -> Result<bool> {
        self.queries.fetch_add(1, Ordering::SeqCst);
        if fence.1.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument("a broken test fence".into()));
        }
        Ok(fence.0.load(Ordering::SeqCst))
    }
    fn read(&self, res: &Self::Reservation, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.inner.read(res, offset, dst)
    }
    fn write(&self, res: &mut Self::Reservation, offset: usize, src: &[u8]) -> Result<()> {
        self.inner.write(res, offset, src)
    }
    fn live(&self) -> LiveCounts {
        let mut l = self.inner.live();
        l.device_syncs += self.syncs.load(Ordering::SeqCst) as u64;
        l
    }
}

impl<B: Backend> FaultBackend<B> {
    /// The placement the inner backend gets: with GPU emulation, GPU 0's
    /// chunks are host chunks.
    fn placed(&self, placement: Location) -> Result<Location> {
        match placement {
            Location::Device(0) if self.emulate_gpu => Ok(Location::Host),
            Location::Device(d) if self.emulate_gpu => Err(Error::InvalidDevice {
                device: d,
                count: 1,
            }),
            p => Ok(p),
        }
    }
}

/// True for the errors a [`FaultBackend`] injects (and nothing else).
pub fn injected(e: &Error) -> bool {
    match e {
        Error::Driver { source, .. } => {
            source.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_PERMITTED
        }
        Error::OutOfMemory { call, .. } => *call == "injected create",
        _ => false,
    }
}

/// Runs `op` on `state` once for each k = 1, 2, … with the k-th driver call
/// of that run failed, until a run ends without reaching a k-th call (which
/// must then succeed). After each run that had its fault, `check(state, k,
/// result)` inspects it and may set the state up for the next k. Returns the
/// number of runs that had a fault: the number of calls `op` makes.
pub fn fail_each_call<B: Backend, S, T: std::fmt::Debug>(
    fb: &FaultBackend<B>,
    state: &mut S,
    mut op: impl FnMut(&mut S) -> Result<T>,
    mut check: impl FnMut(&mut S, usize, Result<T>),
) -> usize {
    let mut k = 1;
    loop {
        let injected = fb.injected();
        fb.fail_nth(k);
        let r = op(state);
        fb.fail_nth(0);
        if fb.injected() == injected {
            r.expect("a run without a fault succeeds");
            return k - 1;
        }
        check(state, k, r);
        k += 1;
    }
}

/// A stream of a fault backend whose fences the test opens by hand; every
/// fence made is logged. `broken` makes `fence` fail (a stream that cannot
/// take one, as one whose capture was invalidated).
#[derive(Clone)]
pub struct Ctl {
    key: u64,
    log: Arc<parking_lot::Mutex<Vec<TestFence>>>,
    pub broken: Arc<AtomicBool>,
}

impl Ctl {
    pub fn new(key: u64) -> Self {
        Self {
            key,
            log: Arc::default(),
            broken: Arc::default(),
        }
    }

    /// Fences made so far.
    pub fn fences(&self) -> usize {
        self.log.lock().len()
    }

    /// Every fence recorded so far passes (the stream's work finished).
    pub fn finish(&self) {
        self.log.lock().iter().for_each(|f| f.pass());
    }
}

impl<B: Backend> vmmbuf::ArenaStream<FaultBackend<B>> for Ctl {
    fn key(&self) -> (u64, u64) {
        (0, self.key)
    }
    fn fence(&self, _: &FaultBackend<B>) -> Result<TestFence> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument(
                "this stream's capture was invalidated".into(),
            ));
        }
        let f = TestFence::default();
        self.log.lock().push(f.clone());
        Ok(f)
    }
}
